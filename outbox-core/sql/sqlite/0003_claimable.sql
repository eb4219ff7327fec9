-- outbox schema, version 3: on PostgreSQL, the indexes of a claim that holds the rows of waiting
-- aggregates. The SQLite claim does not hold rows: nothing changes here; the step keeps the
-- versions the same on every backend.

SELECT 1;
