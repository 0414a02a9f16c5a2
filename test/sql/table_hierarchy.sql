-- idempotency.keys in a DBA's table hierarchy, in a database of its own (a
-- fresh table, so that row positions are known).  Every statement of the
-- API acts on the table itself, never on its inheritance children: reap's
-- delete by ctid (unique only within one table), release, extend, lookup
-- and claim alike.  As a partition, its partition constraint holds: a claim
-- whose row it refuses fails with 23514 and writes nothing.
\set regress_db :DBNAME
CREATE DATABASE idem_hierarchy;
\c idem_hierarchy
CREATE EXTENSION idempotency;

-- An inheritance child: its first record, live, sits at the ctid of an
-- expired record of the parent; its second has the (scope, key, owner) of
-- a claim below.
CREATE TABLE keys_child () INHERITS (idempotency.keys);
SELECT outcome FROM idempotency.claim('old', '\x01', lease => '1 ms', retention => '1 ms');
INSERT INTO keys_child (fence, created_at, expires_at, lease_expires_at, lease, attempt,
		state, owner, scope, key, fingerprint)
	VALUES (999, now(), now() + '10 days', now() + '10 days', '10 days', 1,
		'in_progress', current_user::regrole, '', 'r', '\x02'),
	(1000, now(), now() + '10 days', now() + '10 days', '10 days', 1,
		'in_progress', current_user::regrole, '', 'k', '\x02');
SELECT 'parent' AS t, ctid, key FROM ONLY idempotency.keys
UNION ALL SELECT 'child', ctid, key FROM keys_child ORDER BY 1, 2;
-- reap deletes the parent's expired record, not the child's at its ctid
SELECT pg_sleep(0.01);
SELECT idempotency.reap();
SELECT key, fence FROM keys_child ORDER BY key;
-- The child's record is no record: lookup shows none, claim answers new
-- (mismatch would be the child's fingerprint), and that claim's record is
-- the parent's.
SELECT count(*) FROM idempotency.lookup('k');
SELECT outcome, attempt FROM idempotency.claim('k', '\x01');
SELECT key, encode(fingerprint, 'hex') AS fp FROM idempotency.lookup('k');
-- The child's fence owns nothing: extend and release leave its row alone.
\set VERBOSITY sqlstate
SELECT idempotency.extend('k', 1000, '1 day');
\set VERBOSITY default
SELECT idempotency.release('k', 1000);
SELECT 'parent' AS t, key, state, lease_expires_at < now() + '11 days' AS not_extended
FROM ONLY idempotency.keys
UNION ALL SELECT 'child', key, state, lease_expires_at < now() + '11 days' FROM keys_child
ORDER BY 1, 2;
DROP TABLE keys_child;
DELETE FROM idempotency.keys;

-- As a partition of a table partitioned by scope.
CREATE TABLE all_keys (LIKE idempotency.keys) PARTITION BY LIST (scope);
ALTER TABLE all_keys ATTACH PARTITION idempotency.keys FOR VALUES IN ('tenant-a');
SELECT outcome, fence AS p_fence FROM idempotency.claim('p', '\x01', scope => 'tenant-a') \gset
SELECT :'outcome' AS outcome;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('p', '\x01', scope => 'tenant-b');
SELECT outcome FROM idempotency.claim('q', '\x01', scope => 'tenant-b', token => gen_random_uuid());
\set VERBOSITY default
SELECT idempotency.complete('p', :p_fence, 201, 'made', scope => 'tenant-a');
SELECT outcome, status_code FROM idempotency.claim('p', '\x01', scope => 'tenant-a');
SELECT scope, key, state FROM all_keys ORDER BY scope, key;
SELECT count(*) AS not_in_partition FROM ONLY idempotency.keys WHERE scope <> 'tenant-a';
ALTER TABLE all_keys DETACH PARTITION idempotency.keys;
SELECT outcome FROM idempotency.claim('p2', '\x01', scope => 'tenant-b');
DROP TABLE all_keys;

\c :regress_db
DROP DATABASE idem_hierarchy WITH (FORCE);
