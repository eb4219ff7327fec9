-- outbox schema, version 4: the claims on SQLite and MySQL hold the rows of waiting aggregates,
-- as PostgreSQL's has since version 3: nothing changes here; the step keeps the versions the same
-- on every backend.

SELECT 1;
