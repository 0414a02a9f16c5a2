-- idempotency.stats: counters count calls as they happen; live figures from the table
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idempotency.stats_reset();
SELECT claims_new, claims_replay, reaped, stats_reset_at <= now() AS reset_ok FROM idempotency.stats;

SELECT fence AS f FROM idempotency.claim('st-1', '\x01') \gset
SELECT outcome FROM idempotency.claim('st-1', '\x01');
SELECT outcome FROM idempotency.claim('st-1', '\x02');
SELECT idempotency.complete('st-1', :f, 200);
SELECT outcome FROM idempotency.claim('st-1', '\x01');
SELECT idempotency.complete('st-1', :f, 200);
SELECT fence AS g FROM idempotency.claim('st-2', '\x01', lease => '10 milliseconds') \gset
SELECT pg_sleep(0.05);
SELECT outcome, attempt FROM idempotency.claim('st-2', '\x01', wait => '1s');
SELECT idempotency.release('st-2', :g);
SELECT fence AS h FROM idempotency.keys WHERE key = 'st-2' \gset
SELECT idempotency.complete('st-2', :h, 502);
-- a rolled-back call still counts
BEGIN;
SELECT outcome FROM idempotency.claim('st-3', '\x01');
ROLLBACK;

SELECT claims_new, claims_replay, claims_in_progress, claims_mismatch, takeovers,
       completes_stored, completes_released, releases, fence_rejections
FROM idempotency.stats;
-- the live figures count the table
SELECT s.rows_total = (SELECT count(*) FROM idempotency.keys) AS rows_total_ok,
       s.rows_in_progress = (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') AS in_progress_ok,
       s.rows_in_progress > 0 AS some_in_progress,
       s.oldest_lease_expires_at = (SELECT min(lease_expires_at) FROM idempotency.keys
                                    WHERE state = 'in_progress') AS oldest_ok
FROM idempotency.stats s;
