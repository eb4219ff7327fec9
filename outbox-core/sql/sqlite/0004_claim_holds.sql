-- outbox schema, version 4: on SQLite, the indexes of a claim that holds the rows of waiting
-- aggregates (PostgreSQL's version 3).
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

-- The rows the claim may take, in seq order: not published, parked, held behind a blocked
-- aggregate's earlier event, or backing off. The claim holds (`held_at`) the rows of a waiting
-- aggregate it meets, which takes them out of this index: however many rows wait, each claim reads
-- about one batch of it.
CREATE INDEX IF NOT EXISTS outbox_claimable ON outbox (seq)
    WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NULL AND retry_at IS NULL;

-- The rows backing off, by when they are due: the claim takes the due ones from here.
CREATE INDEX IF NOT EXISTS outbox_retrying ON outbox (retry_at)
    WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NULL AND retry_at IS NOT NULL;
