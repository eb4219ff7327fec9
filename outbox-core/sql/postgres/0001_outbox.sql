-- outbox schema, version 1, PostgreSQL 12 or newer.
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

CREATE TABLE IF NOT EXISTS outbox (
    -- The event id (UUID v7): header `id` on the broker, the consumer's deduplication key.
    id              uuid        PRIMARY KEY,
    -- Commit order within one aggregate; the relay publishes in seq order.
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    aggregate_type  text        NOT NULL,
    -- The broker message key: one aggregate's events share a partition and stay in order.
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    event_version   integer     NOT NULL DEFAULT 1,
    -- Overrides the relay's routing when set.
    topic           text,
    payload         jsonb       NOT NULL,
    -- Broker headers to forward: trace context and user headers, as a JSON object of strings.
    headers         jsonb,
    -- Which of 256 relay shards owns the row; all events of an aggregate share one shard.
    shard           smallint    NOT NULL
                    GENERATED ALWAYS AS ((hashtextextended(aggregate_type || ':' || aggregate_id, 0) & 255)::smallint) STORED,
    -- Failed publish attempts and the last failure, kept by the relay.
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    -- After a transient failure: not before this time. Later events of its aggregate wait.
    retry_at        timestamptz,
    -- Set when the relay gives up on the row (a poison event); later events of its aggregate wait.
    parked_at       timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- NULL until the relay has the broker's ack.
    published_at    timestamptz
);

-- The relay's claim query reads only unpublished rows, in seq order: this index stays small however
-- large the table grows.
CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (seq) WHERE published_at IS NULL;

-- Parked and backing-off rows hold back their aggregate: the claim looks them up here (normally
-- empty).
-- Pruning finds published rows older than the retention window here, in small batches.
CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;

CREATE INDEX IF NOT EXISTS outbox_blocked ON outbox (aggregate_type, aggregate_id)
    WHERE parked_at IS NOT NULL OR retry_at IS NOT NULL;

-- Idempotent consumers: one row per (consumer, event) applied, written in the effect's transaction.
CREATE TABLE IF NOT EXISTS processed_events (
    consumer        text        NOT NULL,
    event_id        uuid        NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
