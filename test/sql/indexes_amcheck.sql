-- Every index on idempotency.keys holds exactly the rows it should after
-- claim's insert and complete's update, which bypass the executor (amcheck
-- reads the heap): the extension's own, an expression and a partial index a
-- DBA adds, more than any fixed limit of them, and one left invalid by a
-- failed CREATE INDEX CONCURRENTLY.  The Makefile leaves this file out where
-- amcheck is not installed (a PostgreSQL built without contrib).
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE EXTENSION IF NOT EXISTS amcheck;

SELECT count(*) AS claimed_before
FROM generate_series(1, 100) i,
     LATERAL idempotency.claim('AMC-' || i, '\x01', scope => 'amcheck') c
WHERE c.outcome = 'new';
CREATE INDEX keys_lower_key ON idempotency.keys ((pg_catalog.lower(key)));
CREATE INDEX keys_completed ON idempotency.keys (completed_at) WHERE state = 'completed';
DO $$
BEGIN
  FOR i IN 1..70 LOOP
    EXECUTE format('CREATE INDEX keys_many_%s ON idempotency.keys ((fence %% %s))', i, i + 1);
  END LOOP;
END $$;
CREATE INDEX CONCURRENTLY keys_failed ON idempotency.keys ((1 / (attempt - 1)));

SELECT indisvalid FROM pg_index WHERE indexrelid = 'idempotency.keys_failed'::regclass;
SELECT count(*) AS claimed_after
FROM generate_series(101, 200) i,
     LATERAL idempotency.claim('AMC-' || i, '\x01', scope => 'amcheck') c
WHERE c.outcome = 'new';
SELECT count(idempotency.complete(key, fence, 201, 'ok', scope => 'amcheck')) AS completed
FROM idempotency.keys WHERE scope = 'amcheck' AND key::text ~ '[02468]$';

SELECT count(*) AS checked,
       count(*) FILTER (WHERE bt_index_check(i.indexrelid, heapallindexed => true) IS NULL)
         AS corrupt
FROM pg_index i
WHERE i.indrelid = 'idempotency.keys'::regclass AND i.indisvalid;

DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT indexrelid::regclass AS idx FROM pg_index
           WHERE indrelid = 'idempotency.keys'::regclass
             AND indexrelid::regclass::text ~ '^idempotency\.keys_(many_|lower_key|completed|failed)' LOOP
    EXECUTE format('DROP INDEX %s', r.idx);
  END LOOP;
END $$;
DELETE FROM idempotency.keys WHERE scope = 'amcheck';
