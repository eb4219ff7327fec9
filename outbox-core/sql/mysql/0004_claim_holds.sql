-- outbox schema, version 4: the indexes of a claim that holds the rows of waiting aggregates
-- (PostgreSQL's version 3). MySQL has no partial index: an index whose leading columns are NULL
-- on the rows wanted, and a generated column that is NULL on the rows not wanted, stand in.
-- The same statements run from outbox_core::migration; apply this file yourself if you manage the
-- schema with another tool.

ALTER TABLE outbox
    -- The aggregate of a row that waits or makes its aggregate wait (unpublished, and parked,
    -- backing off or held), NULL on every other row: one probe of `outbox_waiting` per walked row
    -- finds whether its aggregate waits, and a release finds its aggregate's held rows. The
    -- length prefix keeps ('a:b', 'c') apart from ('a', 'b:c').
    ADD COLUMN waiting_on VARCHAR(520) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
        GENERATED ALWAYS AS (
            IF(published_at IS NULL
                   AND (parked_at IS NOT NULL OR retry_at IS NOT NULL OR held_at IS NOT NULL),
               CONCAT(CHAR_LENGTH(aggregate_type), ':', aggregate_type, aggregate_id), NULL)
        ) VIRTUAL,
    ADD KEY outbox_waiting (waiting_on, seq),
    -- The claim walks the rows with all four columns NULL in seq order (the rows it may take:
    -- not published, parked, held or backing off); the backlog is counted from the NULL prefix
    -- of the first, pruning reads its other end.
    DROP KEY outbox_unpublished,
    ADD KEY outbox_unpublished (published_at, parked_at, held_at, retry_at, seq);
