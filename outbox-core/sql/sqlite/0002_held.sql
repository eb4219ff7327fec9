-- outbox schema, version 2: what the WAL source keeps of events it holds back (SQLite has no WAL
-- source; the columns keep the two schemas the same).
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

ALTER TABLE outbox ADD COLUMN held_at TEXT;
ALTER TABLE outbox ADD COLUMN recorded BLOB;

CREATE INDEX IF NOT EXISTS outbox_held ON outbox (aggregate_type, aggregate_id) WHERE held_at IS NOT NULL;
