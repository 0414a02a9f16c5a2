-- complete_row: complete first looks for its claim's row where this
-- backend's claim inserted it; what it finds there must be that claim's,
-- or complete reads the key index as before.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- The claim's fence with another scope or another key stores nothing.
SELECT fence AS f FROM idempotency.claim('row-1', '\x01', scope => 'tenant_a') \gset
SELECT idempotency.complete('row-1', :f, 200, 'b', scope => 'tenant_b');
SELECT idempotency.complete('row-2', :f, 200, 'b', scope => 'tenant_a');
SELECT idempotency.complete('row-1', :f, 200, 'a', scope => 'tenant_a');
SELECT scope, key, status_code, body FROM idempotency.keys WHERE key LIKE 'row-%';

-- A row version replaced since (a checkpoint updates the claim's row):
-- found through the key index.
SELECT fence AS f FROM idempotency.claim('row-3', '\x01') \gset
SELECT idempotency.checkpoint('row-3', :f, 'charged');
SELECT idempotency.complete('row-3', :f, 201, 'c');
SELECT key, status_code, body FROM idempotency.keys WHERE key = 'row-3';

-- The claim's page gone from the table (here by TRUNCATE, as VACUUM may
-- truncate an emptied end of it): no read past the table's end.
SELECT fence AS f FROM idempotency.claim('row-4', '\x01') \gset
TRUNCATE idempotency.keys;
SELECT idempotency.complete('row-4', :f, 200, 'd');

-- An aborted claim's row is not seen.
BEGIN;
SELECT fence AS f FROM idempotency.claim('row-5', '\x01') \gset
ROLLBACK;
SELECT idempotency.complete('row-5', :f, 200, 'e');
