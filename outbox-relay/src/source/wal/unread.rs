//! The slot's unread WAL, read without consuming it (a peek decodes the WAL from the slot's
//! confirmed position up to now): the outbox rows inserted there and the table-less events.
//! `wal drop` counts them before dropping the slot; `wal to-polling` leaves those rows to the
//! polling relays and refuses if table-less events are there.

use super::pgoutput::{Change, Decoder, Value};
use crate::config::WalSource;
use crate::error::SourceError;
use bytes::{Buf, Bytes};
use futures::TryStreamExt;
use sqlx::PgConnection;

/// What the slot's unread WAL holds.
#[derive(Default)]
pub(super) struct Unread {
    /// The ids of the outbox rows inserted there.
    pub row_ids: Vec<uuid::Uuid>,
    /// Those of them the reading transaction's snapshot sees (committed before it): a row of these
    /// missing from the table was pruned, where the others may just be too new for the snapshot.
    pub visible_row_ids: Vec<uuid::Uuid>,
    /// Table-less events there, and how many of them were recorded since a given position.
    pub table_less: u64,
    pub table_less_since_start: u64,
}

/// Reads the slot's unread WAL without consuming it (its publication must exist; PostgreSQL
/// refuses while a relay reads the slot). Table-less events at or after `since_lsn` are counted
/// apart.
pub(super) async fn peek(
    tx: &mut PgConnection,
    source: &WalSource,
    since_lsn: &str,
) -> Result<Unread, SourceError> {
    let outbox: sqlx::postgres::types::Oid = sqlx::query_scalar("SELECT 'outbox'::regclass::oid")
        .fetch_one(&mut *tx)
        .await?;
    let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&mut *tx)
        .await?;
    let snapshot = Snapshot::parse(&snapshot).ok_or_else(|| {
        SourceError::Replication(format!("a snapshot not understood: {snapshot}"))
    })?;
    let mut changes = sqlx::query_as::<_, (bool, i64, Vec<u8>)>(
        "SELECT lsn >= $3::pg_lsn, xid::text::int8, data
         FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
             'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
    )
    .bind(&source.slot)
    .bind(&source.publication)
    .bind(since_lsn)
    .fetch(&mut *tx);
    let mut decoder = Decoder::default();
    let mut unread = Unread::default();
    while let Some((since_start, xid, data)) = changes.try_next().await? {
        let data = Bytes::from(data);
        if data.first() == Some(&b'M') {
            if message_prefix(data.clone()).as_deref()
                == Some(seaorm_outbox::LOGICAL_MESSAGE_PREFIX)
            {
                unread.table_less += 1;
                unread.table_less_since_start += u64::from(since_start);
            }
            continue;
        }
        let change = decoder.decode(data).map_err(SourceError::Replication)?;
        if let Change::Insert { relation, values } = change
            && relation == outbox.0
        {
            let relation = decoder.relation(relation).ok_or_else(|| {
                SourceError::Replication("an insert into a relation it did not describe".into())
            })?;
            let id = relation
                .columns
                .iter()
                .position(|c| c == "id")
                .and_then(|i| values.get(i))
                .and_then(|v| match v {
                    Value::Text(text) => std::str::from_utf8(text).ok(),
                    _ => None,
                })
                .and_then(|text| uuid::Uuid::parse_str(text).ok());
            if let Some(id) = id {
                unread.row_ids.push(id);
                if snapshot.sees(xid as u32) {
                    unread.visible_row_ids.push(id);
                }
            }
        }
    }
    Ok(unread)
}

/// A transaction snapshot (`pg_current_snapshot()`: `xmin:xmax:xip,...`), reduced to the 32-bit
/// transaction ids the WAL carries: which transactions committed before it.
struct Snapshot {
    xmax: u32,
    in_progress: Vec<u32>,
}

impl Snapshot {
    fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.split(':');
        let _xmin = parts.next()?;
        let xmax = parts.next()?.parse::<u64>().ok()? as u32;
        let in_progress = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse::<u64>().ok().map(|x| x as u32))
                .collect::<Option<_>>()?,
        };
        Some(Snapshot { xmax, in_progress })
    }

    /// Whether the committed transaction `xid` is visible to the snapshot: it began before the
    /// snapshot's `xmax` (in the modulo-2^32 order of transaction ids) and was not running then.
    fn sees(&self, xid: u32) -> bool {
        (xid.wrapping_sub(self.xmax) as i32) < 0 && !self.in_progress.contains(&xid)
    }
}

/// The prefix of a logical message (`M`, flags, LSN, prefix, length, content).
fn message_prefix(mut data: Bytes) -> Option<String> {
    if data.remaining() < 10 {
        return None;
    }
    data.advance(10);
    let end = data.iter().position(|b| *b == 0)?;
    String::from_utf8(data[..end].to_vec()).ok()
}

#[cfg(test)]
mod tests {
    use super::Snapshot;

    #[test]
    fn a_snapshot_sees_what_committed_before_it() {
        let s = Snapshot::parse("4294967390:4294967400:4294967395,4294967397").unwrap();
        // 4294967400 is 104 in the second epoch.
        assert!(s.sees(100) && s.sees(103), "committed before it");
        assert!(s.sees(u32::MAX), "of the epoch before");
        assert!(!s.sees(104) && !s.sees(200), "begun after it");
        assert!(!s.sees(99) && !s.sees(101), "running then");
        let empty = Snapshot::parse("750:750:").unwrap();
        assert!(empty.sees(749) && !empty.sees(750));
    }
}
