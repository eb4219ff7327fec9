-- outbox schema, version 2: the columns the PostgreSQL WAL source keeps held and table-less events
-- in. No MySQL source uses them yet; they keep the table the same on every backend.
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

ALTER TABLE outbox ADD COLUMN held_at DATETIME(6), ADD COLUMN recorded LONGBLOB;
