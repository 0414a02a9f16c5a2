-- FORCE ROW LEVEL SECURITY on the records is refused (0A000) as in the C
-- edition, whoever owns the table: also on claim's hot path, for a replay
-- and for a new key, where the owner (here a superuser) bypasses row
-- security and the policies would not hide a record from it.
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT fence AS f FROM idempotency.claim('frls-1', '\x01') \gset
SELECT idempotency.complete('frls-1', :f, 200);
ALTER TABLE idempotency.keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency.keys FORCE ROW LEVEL SECURITY;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('frls-1', '\x01');
SELECT outcome FROM idempotency.claim('frls-2', '\x01');
\set VERBOSITY default
SELECT count(*) AS written FROM idempotency.keys WHERE key = 'frls-2';
-- row security enabled, not forced: the owner bypasses it, as before
ALTER TABLE idempotency.keys NO FORCE ROW LEVEL SECURITY;
SELECT outcome FROM idempotency.claim('frls-1', '\x01');
ALTER TABLE idempotency.keys DISABLE ROW LEVEL SECURITY;
DELETE FROM idempotency.keys WHERE key LIKE 'frls-%';
