-- 1.6 in the portable edition: no index of the records in progress, so that
-- complete's update is HOT; without the C edition's shared memory,
-- idempotency.stats counts a table of up to 10,000 records, and on a larger
-- one says that its figures are an estimate, as the C edition does
-- without preloading.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- no partial index (the in-progress index of 1.3 to 1.5 had a predicate on state)
SELECT count(*) AS partial_indexes FROM pg_index
WHERE indrelid = 'idempotency.keys'::regclass AND indpred IS NOT NULL;

-- a small table: counted, exact
SELECT fence AS f FROM idempotency.claim('stp-1', '\x01', lease => '10 milliseconds') \gset
SELECT pg_sleep(0.05);
SELECT s.rows_in_progress = (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') AS counted,
       s.oldest_lease_expires_at = (SELECT min(lease_expires_at) FROM idempotency.keys
                                    WHERE state = 'in_progress') AS oldest_ok,
       s.live_figures_exact
FROM idempotency.stats s;
SELECT idempotency.leases_ended('0', '1 hour') =
       (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress'
        AND lease_expires_at BETWEEN now() - '1 hour'::interval AND now()) AS leases_counted;
SELECT idempotency.stats_recount() AS exact;
SELECT idempotency.complete('stp-1', :f, 200);

-- over 10,000 records: rows_in_progress an estimate from the planner's
-- statistics, oldest_lease_expires_at and leases_ended NULL, not exact
SELECT count(*) FILTER (WHERE c.outcome = 'new') AS claimed
FROM generate_series(1, 10001) i, idempotency.claim('stp-big-' || i, '\x01', lease => '1h') c;
SELECT count(*) FILTER (WHERE idempotency.complete(k.key, k.fence, 200) = 'stored') AS completed
FROM idempotency.keys k WHERE k.key LIKE 'stp-big-%' AND right(k.key, 1) IN ('0', '2', '4', '6', '8');
SELECT pg_stat_force_next_flush();
ANALYZE idempotency.keys;
SELECT abs(s.rows_in_progress - (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress'))
           < (SELECT count(*) FROM idempotency.keys) / 20 AS estimated,
       s.rows_total >= 10001 AS total_ok,
       s.oldest_lease_expires_at IS NULL AS no_oldest,
       s.live_figures_exact
FROM idempotency.stats s;
SELECT idempotency.leases_ended('0', '1 hour') IS NULL AS leases_unknown;
SELECT idempotency.stats_recount() AS exact;
DELETE FROM idempotency.keys WHERE key LIKE 'stp-big-%';
SELECT pg_stat_force_next_flush();
ANALYZE idempotency.keys;
SELECT live_figures_exact FROM idempotency.stats;
