-- outbox schema, version 2: what the WAL source keeps of events it holds back.
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

-- Set by the WAL source on an event waiting behind a parked event of its aggregate (the polling
-- relay needs no mark: its waiting events are simply unpublished). `failed retry` and `failed skip`
-- release them, in seq order.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS held_at timestamptz;
-- A table-less event the WAL source parked or held, exactly as it was recorded (the logical
-- message's JSON of the event, or the whole message when it cannot be read): published from
-- these bytes when it is released, since `payload` (jsonb) and `id` (uuid) cannot hold them all.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS recorded bytea;

-- A release looks up an aggregate's held events here (normally empty).
CREATE INDEX IF NOT EXISTS outbox_held ON outbox (aggregate_type, aggregate_id) WHERE held_at IS NOT NULL;
