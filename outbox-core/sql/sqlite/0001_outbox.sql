-- outbox schema, version 1, SQLite 3.35 or newer.
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.
--
-- Differences from PostgreSQL: SQLite's AUTOINCREMENT must be the primary key, so `seq` is the
-- primary key and `id` is UNIQUE; uuids and timestamps are TEXT; `shard` is always 0 (a single
-- relay serves a SQLite database).

CREATE TABLE IF NOT EXISTS outbox (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT    NOT NULL UNIQUE,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    event_version   INTEGER NOT NULL DEFAULT 1,
    topic           TEXT,
    payload         TEXT    NOT NULL,
    headers         TEXT,
    shard           INTEGER NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    retry_at        TEXT,
    parked_at       TEXT,
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    published_at    TEXT
);

CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (seq) WHERE published_at IS NULL;
-- Pruning finds published rows older than the retention window here, in small batches.
CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;

CREATE INDEX IF NOT EXISTS outbox_blocked ON outbox (aggregate_type, aggregate_id)
    WHERE parked_at IS NOT NULL OR retry_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS processed_events (
    consumer        TEXT    NOT NULL,
    event_id        TEXT    NOT NULL,
    processed_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, event_id)
);
