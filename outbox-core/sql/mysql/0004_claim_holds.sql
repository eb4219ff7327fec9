-- outbox schema, version 4: SQLite's claim holds the rows of waiting aggregates, as PostgreSQL's
-- has since version 3. The MySQL claim does not hold rows yet: nothing changes here; the step
-- keeps the versions the same on every backend.

DO 0;
