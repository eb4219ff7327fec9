-- outbox schema, version 3: on PostgreSQL, the indexes of a claim that holds the rows of waiting
-- aggregates. The MySQL claim does not hold rows yet: nothing changes here; the step keeps the
-- versions the same on every backend.

DO 0;
