-- idempotency.stats: counters count calls as they happen; live figures from the table
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idempotency.stats_reset();
-- the live figures are exact once counted since the server started (the
-- reaper counts at its next run; stats_recount() at once)
SELECT idempotency.stats_recount() AS exact;
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
-- the live figures: rows_in_progress and oldest_lease_expires_at exact
-- (kept by the library from the API's writes, applied at commit),
-- rows_total the cumulative statistics' estimate (exact here once this
-- session's statistics are flushed, as nothing else writes)
SELECT pg_stat_force_next_flush();
SELECT s.rows_total = (SELECT count(*) FROM idempotency.keys) AS rows_total_ok,
       s.rows_in_progress = (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') AS in_progress_ok,
       s.rows_in_progress > 0 AS some_in_progress,
       s.oldest_lease_expires_at = (SELECT min(lease_expires_at) FROM idempotency.keys
                                    WHERE state = 'in_progress') AS oldest_ok,
       s.live_figures_exact
FROM idempotency.stats s;
SELECT col.description
FROM pg_attribute a JOIN pg_description col
  ON col.objoid = a.attrelid AND col.objsubid = a.attnum
WHERE a.attrelid = 'idempotency.stats'::regclass AND a.attname = 'rows_total';

-- only what commits counts: a rolled-back savepoint or transaction, nothing
SELECT rows_in_progress AS n0 FROM idempotency.stats \gset
BEGIN;
SELECT fence AS r1 FROM idempotency.claim('st-rb-1', '\x01') \gset
SELECT rows_in_progress = :n0 AS not_before_commit FROM idempotency.stats;
SAVEPOINT sp;
SELECT outcome FROM idempotency.claim('st-rb-2', '\x01');
SELECT idempotency.complete('st-rb-1', :r1, 200);
ROLLBACK TO SAVEPOINT sp;
SAVEPOINT sp2;
SELECT outcome FROM idempotency.claim('st-rb-3', '\x01');
RELEASE SAVEPOINT sp2;
COMMIT;
SELECT rows_in_progress - :n0 AS added, live_figures_exact FROM idempotency.stats;
BEGIN;
SELECT outcome FROM idempotency.claim('st-rb-4', '\x01');
ROLLBACK;
SELECT rows_in_progress - :n0 AS added,
       rows_in_progress = (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') AS n_ok
FROM idempotency.stats;

-- complete's update is HOT again (1.6): no index reads a column it changes
SELECT pg_stat_force_next_flush();
SELECT n_tup_upd AS upd0, n_tup_hot_upd AS hot0 FROM pg_stat_user_tables
WHERE relid = 'idempotency.keys'::regclass \gset
SELECT count(*) FILTER (WHERE idempotency.complete(k, (idempotency.claim(k, '\x01')).fence, 200) = 'stored')
FROM (SELECT 'st-hot-' || i AS k FROM generate_series(1, 10) i) keys;
SELECT pg_stat_force_next_flush();
SELECT n_tup_upd - :upd0 AS updates, n_tup_hot_upd - :hot0 > 0 AS some_hot
FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass;

-- leases_ended (1.6, for alerting): the records in progress whose lease
-- ended in a window, from the library's figures: what a count of the table
-- finds for the same window, as committed
SELECT fence AS e1 FROM idempotency.claim('st-le-1', '\x01', lease => '10 milliseconds') \gset
SELECT fence AS e2 FROM idempotency.claim('st-le-2', '\x01', lease => '10 milliseconds') \gset
SELECT outcome FROM idempotency.claim('st-le-3', '\x01', lease => '1h');
SELECT pg_sleep(0.05);
-- (of_st_le: the figure less the other tests' records a count finds in it)
PREPARE leases_ended(interval, interval) AS
SELECT idempotency.leases_ended($1, $2) -
           (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress'
            AND key NOT LIKE 'st-le-%' AND lease_expires_at BETWEEN now() - $2 AND now() - $1)
           AS of_st_le,
       idempotency.leases_ended($1, $2) =
           (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress'
            AND lease_expires_at BETWEEN now() - $2 AND now() - $1) AS as_counted,
       (SELECT live_figures_exact FROM idempotency.stats) AS exact;
EXECUTE leases_ended('0', '1 hour');
EXECUTE leases_ended('1 hour', '2 hours');
-- a lease extended leaves the window; a record completed too, once committed
SELECT idempotency.extend('st-le-1', :e1, '1h') > now() AS extended;
EXECUTE leases_ended('0', '1 hour');
BEGIN;
SELECT idempotency.complete('st-le-2', :e2, 200);
EXECUTE leases_ended('0', '1 hour');
COMMIT;
EXECUTE leases_ended('0', '1 hour');
DEALLOCATE leases_ended;
\set VERBOSITY sqlstate
SELECT idempotency.leases_ended(NULL, '15 minutes');
SELECT idempotency.leases_ended('1 minute', NULL);
SELECT idempotency.leases_ended('-1 minute', '15 minutes');
SELECT idempotency.leases_ended('15 minutes', '1 minute');
\set VERBOSITY default

-- reading the statistics does not scan the records
SELECT pg_stat_force_next_flush();
SELECT seq_scan AS scans_before FROM pg_stat_user_tables
WHERE relid = 'idempotency.keys'::regclass \gset
SELECT rows_in_progress >= 0 AS read FROM idempotency.stats;
SELECT rows_in_progress >= 0 AS read FROM idempotency.stats;
SELECT idempotency.leases_ended('1 minute', '15 minutes') >= 0 AS read;
SELECT pg_stat_force_next_flush();
SELECT seq_scan = :scans_before AS no_scan FROM pg_stat_user_tables
WHERE relid = 'idempotency.keys'::regclass;

-- in_flight: the records in progress, oldest first; for pg_monitor only
SELECT fence AS i1 FROM idempotency.claim('st-fl-1', '\x01', scope => 'acct', lease => '1h') \gset
SELECT fence AS i2 FROM idempotency.claim('st-fl-2', '\x01', lease => '2h') \gset
SELECT idempotency.checkpoint('st-fl-1', :i1, 'charged', scope => 'acct');
SELECT scope, key, owner, attempt, claimed_at <= now() AS claimed_ok,
       lease_expires_at > now() AS live, recovery_point, writing
FROM idempotency.in_flight WHERE key LIKE 'st-fl-%';
SELECT (SELECT count(*) FROM idempotency.in_flight) =
       (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') AS all_listed;
SELECT bool_and(a.claimed_at <= b.claimed_at) AS oldest_first
FROM (SELECT claimed_at, row_number() OVER () AS n FROM idempotency.in_flight) a
JOIN (SELECT claimed_at, row_number() OVER () AS n FROM idempotency.in_flight) b ON b.n = a.n + 1;
SELECT idempotency.complete('st-fl-1', :i1, 200, scope => 'acct');
SELECT idempotency.release('st-fl-2', :i2);
SELECT count(*) FROM idempotency.in_flight WHERE key LIKE 'st-fl-%';
CREATE ROLE idem_stats_app;
CREATE ROLE idem_stats_monitor IN ROLE pg_monitor;
GRANT USAGE ON SCHEMA idempotency TO idem_stats_app;
SET ROLE idem_stats_monitor;
SELECT count(*) >= 0 AS monitor_reads FROM idempotency.in_flight;
SELECT idempotency.leases_ended('1 minute', '15 minutes') >= 0 AS monitor_reads;
SET ROLE idem_stats_app;
\set VERBOSITY sqlstate
SELECT * FROM idempotency.in_flight;
SELECT * FROM idempotency._stats_figures();
SELECT idempotency.leases_ended('1 minute', '15 minutes');
SELECT idempotency.stats_recount();
\set VERBOSITY default
RESET ROLE;
REVOKE USAGE ON SCHEMA idempotency FROM idem_stats_app;
DROP ROLE idem_stats_app, idem_stats_monitor;

-- a recount in a transaction that wrote records would count them twice: refused
BEGIN;
SELECT outcome FROM idempotency.claim('st-rc-1', '\x01');
\set VERBOSITY sqlstate
SELECT idempotency.stats_recount();
\set VERBOSITY default
ROLLBACK;
