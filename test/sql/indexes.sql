-- Indexes a DBA adds to idempotency.keys are kept right by claim's insert
-- and complete's update, which bypass the executor: an expression index,
-- a partial one, and the extension's own expression index; an exclusion
-- constraint, which they cannot maintain, sends them through the executor.
CREATE EXTENSION IF NOT EXISTS idempotency;

CREATE INDEX keys_lower_key ON idempotency.keys ((pg_catalog.lower(key)));
CREATE INDEX keys_completed ON idempotency.keys (completed_at) WHERE state = 'completed';

SELECT count(*) AS claimed
FROM generate_series(1, 200) i,
     LATERAL idempotency.claim('IDX-' || i, '\x01', scope => 'indexes') c;
SELECT count(idempotency.complete(key, fence, 201, 'ok', scope => 'indexes')) AS completed
FROM idempotency.keys WHERE scope = 'indexes' AND key::text ~ '[02468]$';

-- the indexes find what a scan of the table finds (indexes_amcheck checks
-- every entry where amcheck is installed)
SET enable_seqscan = off;
SET enable_bitmapscan = off;
SELECT count(*) AS by_expression FROM idempotency.keys WHERE pg_catalog.lower(key) = 'idx-7';
EXPLAIN (COSTS OFF) SELECT count(*) FROM idempotency.keys
WHERE state = 'completed' AND completed_at IS NOT NULL;
SELECT count(*) AS completed_by_partial FROM idempotency.keys
WHERE state = 'completed' AND completed_at IS NOT NULL \gset
RESET enable_seqscan;
RESET enable_bitmapscan;
SELECT count(*) = :completed_by_partial AS partial_index_agrees
FROM idempotency.keys WHERE state = 'completed';

-- an exclusion constraint, which the direct writes cannot check, sends
-- them through the executor: it is enforced, and a refused claim writes nothing
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_one_per_key EXCLUDE USING btree (key WITH =);
SELECT outcome FROM idempotency.claim('IDX-excluded', '\x01', scope => 'indexes');
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('IDX-excluded', '\x01', scope => 'indexes-other');
\set VERBOSITY default
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_one_per_key;
SELECT scope, count(*) AS excluded_written FROM idempotency.keys WHERE key = 'IDX-excluded'
GROUP BY scope;

DROP INDEX idempotency.keys_lower_key, idempotency.keys_completed;
DELETE FROM idempotency.keys WHERE scope = 'indexes';
