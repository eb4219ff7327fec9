-- outbox schema, version 1, in the partitioned layout: PostgreSQL 13 or newer. Opt-in, instead of
-- the first statement of ../postgres/0001_outbox.sql; then apply ../postgres/0001_outbox.sql (its CREATE TABLE does
-- nothing on this table, its indexes are made on every partition) and the later versions as usual.
-- `outbox-relay migrate --partitioned 1d` runs all of it and makes the first partitions.
--
-- The same columns and meaning as the plain layout. The rows are ranged by `created_at`, one
-- partition per interval (`outbox_p20261207_0000` holds one day, or one hour, as chosen at
-- migrate), made a few intervals ahead by the relay. Retention drops a partition whose rows are all
-- published instead of deleting its rows one by one. A row that finds no partition of its
-- interval (the relay stopped for longer than its lead) goes to `outbox_default`, which the relay
-- prunes row by row as it prunes the plain layout: recording never fails for want of a partition.

CREATE TABLE IF NOT EXISTS outbox (
    id              uuid        NOT NULL,
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    event_version   integer     NOT NULL DEFAULT 1,
    topic           text,
    payload         jsonb       NOT NULL,
    headers         jsonb,
    shard           smallint    NOT NULL
                    GENERATED ALWAYS AS ((hashtextextended(aggregate_type || ':' || aggregate_id, 0) & 255)::smallint) STORED,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    retry_at        timestamptz,
    parked_at       timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- A partitioned table's unique keys must hold its partition key. The id (UUID v7) is unique
    -- on its own as before; nothing in the relay relies on the database to say so.
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

CREATE TABLE IF NOT EXISTS outbox_default PARTITION OF outbox DEFAULT;
