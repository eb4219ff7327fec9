-- outbox schema, version 1, MySQL 8.0.16+ and MariaDB 10.6+ (SQL both accept).
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

CREATE TABLE IF NOT EXISTS outbox (
    -- The event id (UUID v7, as text): header `id` on the broker, the consumer's deduplication key.
    id              CHAR(36)      CHARACTER SET ascii NOT NULL,
    -- Commit order within one aggregate; the relay publishes in seq order. The primary key, so
    -- InnoDB keeps the rows in seq order.
    seq             BIGINT        NOT NULL AUTO_INCREMENT,
    aggregate_type  VARCHAR(255)  NOT NULL,
    -- The broker message key: one aggregate's events share a partition and stay in order.
    aggregate_id    VARCHAR(255)  NOT NULL,
    event_type      VARCHAR(255)  NOT NULL,
    event_version   INT           NOT NULL DEFAULT 1,
    -- Overrides the relay's routing when set.
    topic           VARCHAR(255),
    -- The payload JSON exactly as the application serialized it: text, not MySQL's JSON type,
    -- which would rewrite the document (key order, spacing) before it reaches the broker.
    payload         LONGTEXT      NOT NULL,
    -- Broker headers to forward: trace context and user headers, as a JSON object of strings.
    headers         TEXT,
    -- Which of 256 relay shards owns the row; all events of an aggregate share one shard.
    shard           SMALLINT      GENERATED ALWAYS AS (CRC32(CONCAT(aggregate_type, ':', aggregate_id)) & 255) STORED,
    -- Failed publish attempts and the last failure, kept by the relay.
    attempts        INT           NOT NULL DEFAULT 0,
    last_error      TEXT,
    -- After a transient failure: not before this time (UTC). Later events of its aggregate wait.
    retry_at        DATETIME(6),
    -- Set when the relay gives up on the row (a poison event); later events of its aggregate wait.
    parked_at       DATETIME(6),
    -- UTC, as every time in these tables.
    created_at      DATETIME(6)   NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- NULL until the relay has the broker's ack.
    published_at    DATETIME(6),
    PRIMARY KEY (seq),
    UNIQUE KEY outbox_id (id),
    -- MySQL has no partial index: the claim reads the NULL prefix of this one in seq order, so its
    -- cost stays flat however large the published history grows; pruning reads its other end.
    KEY outbox_unpublished (published_at, seq),
    -- Parked and backing-off rows hold back their aggregate: the claim finds them through these,
    -- in the range of rows with the column set (normally none), not among every row.
    KEY outbox_parked (parked_at),
    KEY outbox_retrying (retry_at),
    CONSTRAINT outbox_payload_json CHECK (JSON_VALID(payload))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Per-aggregate commit order: `record` locks its aggregates' buckets here (FOR UPDATE, in
-- ascending order, until commit) before inserting, so a second writer of an aggregate takes its
-- seq only after the first has committed. The bucket of an aggregate is
-- CRC32(CONCAT(aggregate_type, ':', aggregate_id)) & 65535; writers in other languages run
-- `SELECT bucket FROM outbox_lock WHERE bucket = ? FOR UPDATE` for each, ascending, first.
CREATE TABLE IF NOT EXISTS outbox_lock (
    bucket          INT           NOT NULL PRIMARY KEY
) ENGINE = InnoDB;

-- The 65,536 buckets, from sixteen digits (a CTE both MySQL 8 and MariaDB accept here).
INSERT IGNORE INTO outbox_lock (bucket)
WITH digit AS (
    SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
    UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9
    UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12 UNION ALL SELECT 13
    UNION ALL SELECT 14 UNION ALL SELECT 15
)
SELECT a.n * 4096 + b.n * 256 + c.n * 16 + d.n FROM digit a, digit b, digit c, digit d;

-- Idempotent consumers: one row per (consumer, event) applied, written in the effect's transaction.
CREATE TABLE IF NOT EXISTS processed_events (
    consumer        VARCHAR(255)  NOT NULL,
    event_id        CHAR(36)      CHARACTER SET ascii NOT NULL,
    processed_at    DATETIME(6)   NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, event_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
