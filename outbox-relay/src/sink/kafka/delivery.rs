//! What the broker's answers mean for the relay: a delivery report, and an error's kind.

use super::SinkError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::future_producer::OwnedDeliveryResult;

/// What a delivery report means for the relay. Unless `acks` is 0, the broker tells the offset
/// of each message it wrote. librdkafka also reports messages as delivered without one: those it
/// took as written because a later batch of their partition was ("implicitly acked by subsequent
/// batch success"), and a batch the broker called a duplicate of an earlier send. Neither is proof:
/// on a partition that just got its leader, the broker refused a producer's first two batches
/// (`Not leader for partition`) and accepted its third, pipelined behind them, as the first of
/// that producer; librdkafka then reported the refused messages delivered, and they were never
/// written (seen in `tests/wal.rs`, the broker-timeout test, 2 events of 5,600 lost, librdkafka
/// 2.12.1 against Kafka 4). So a delivery without an offset is a failure, and the relay sends the
/// message again: a duplicate at worst, never a loss.
pub(super) fn delivery(
    delivered: OwnedDeliveryResult,
    offsets_reported: bool,
) -> Result<(), SinkError> {
    match delivered {
        Ok(delivery) if offsets_reported && delivery.offset < 0 => Err(SinkError::new(format!(
            "delivered without an offset (partition {}): the broker never confirmed writing it; \
             sending it again",
            delivery.partition
        ))),
        Ok(_) => Ok(()),
        Err((e, _)) => Err(classify(&e)),
    }
}

/// Errors no retry can fix: the message, its topic or the relay's rights must change first.
pub(super) fn classify(error: &KafkaError) -> SinkError {
    use RDKafkaErrorCode as Code;
    let permanent = matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
                | Code::MessageBatchTooLarge
                | Code::UnknownTopic
                | Code::UnknownTopicOrPartition
                | Code::InvalidTopic
                | Code::TopicAuthorizationFailed
                | Code::ClusterAuthorizationFailed
        )
    );
    let message = error.to_string();
    if permanent {
        SinkError::permanent(message)
    } else {
        SinkError::new(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;
    use rdkafka::producer::future_producer::Delivery;

    /// A delivery report at `offset`.
    fn delivered(offset: i64) -> Delivery {
        Delivery {
            partition: 1,
            offset,
            timestamp: Timestamp::NotAvailable,
        }
    }

    #[test]
    fn a_delivery_without_an_offset_is_sent_again_unless_acks_is_0() {
        assert!(delivery(Ok(delivered(42)), true).is_ok());
        let unconfirmed = delivery(Ok(delivered(-1)), true).unwrap_err();
        assert!(!unconfirmed.is_permanent());
        assert!(
            unconfirmed.message.contains("without an offset"),
            "{}",
            unconfirmed.message
        );
        // librdkafka's "invalid offset", which messages it acked implicitly keep.
        assert!(delivery(Ok(delivered(-1001)), true).is_err());
        // With acks=0 the broker never tells offsets: every delivery is one without.
        assert!(delivery(Ok(delivered(-1)), false).is_ok());
    }
}
