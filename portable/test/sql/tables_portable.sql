-- Every statement of the portable edition acts on idempotency.keys itself
-- (ONLY), never on a DBA's inheritance child; as a partition, the table
-- keeps its partition constraint.  The table is emptied first, so that the
-- child's first row and the parent's share a ctid (0,1), as reap's
-- DELETE ... WHERE ctid = ANY (...) once confused them.
CREATE EXTENSION IF NOT EXISTS idempotency;
TRUNCATE idempotency.keys;

-- the parent's expired record, and an inheritance child holding a live
-- record of another key
INSERT INTO idempotency.keys (fence, created_at, expires_at, attempt, owner, lease,
  lease_expires_at, state, scope, key, fingerprint)
VALUES (nextval('idempotency.fence_seq'), now() - interval '2 hours', now() - interval '1 hour', 1,
  current_user::regrole, interval '1 minute', now() - interval '1 hour', 'in_progress', 'tables',
  'Inh-1', '\x01');
CREATE TABLE public.idem_keys_child () INHERITS (idempotency.keys);
INSERT INTO public.idem_keys_child (fence, created_at, expires_at, attempt, owner, lease,
  lease_expires_at, state, scope, key, fingerprint, status_code, body, completed_at)
VALUES (1000000, now(), now() + interval '10 days', 1, current_user::regrole, NULL, NULL,
  'completed', 'tables', 'Inh-2', '\x02', 200, 'child', now());
SELECT (SELECT ctid FROM ONLY idempotency.keys WHERE key = 'Inh-1')
     = (SELECT ctid FROM public.idem_keys_child WHERE key = 'Inh-2') AS same_ctid;
-- claim, lookup, complete do not see the child's record
SELECT count(*) AS child_seen FROM idempotency.lookup('Inh-2', 'tables');
SELECT outcome, attempt FROM idempotency.claim('Inh-2', '\x09', scope => 'tables');
SELECT fence AS inh_fence FROM ONLY idempotency.keys WHERE key = 'Inh-2' \gset
SELECT idempotency.complete('Inh-2', :inh_fence, 201, 'parent', scope => 'tables');
-- reap deletes the parent's expired row only
SELECT idempotency.reap() AS reaped;
SELECT tableoid::regclass AS in_table, key, state, convert_from(body, 'UTF8') AS body
FROM idempotency.keys WHERE scope = 'tables' ORDER BY 1, 2;
-- nor do the statistics and in_flight count the child's record in progress
INSERT INTO public.idem_keys_child (fence, created_at, expires_at, attempt, owner, lease,
  lease_expires_at, state, scope, key, fingerprint)
VALUES (1000001, now(), now() + interval '10 days', 1, current_user::regrole, interval '1 day',
  now() + interval '1 day', 'in_progress', 'tables', 'Inh-3', '\x03');
SELECT rows_in_progress, (SELECT count(*) FROM idempotency.in_flight) AS in_flight
FROM idempotency.stats;
DROP TABLE public.idem_keys_child;

-- the table as a partition for tenant-a: a claim of tenant-b is refused
-- (23514) and writes nothing; tenant-a's is seen through the parent
TRUNCATE idempotency.keys;
CREATE TABLE public.idem_keys_parts (LIKE idempotency.keys) PARTITION BY LIST (scope);
ALTER TABLE public.idem_keys_parts ATTACH PARTITION idempotency.keys FOR VALUES IN ('tenant-a');
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Part-1', '\x01', scope => 'tenant-b');
\set VERBOSITY default
SELECT outcome FROM idempotency.claim('Part-1', '\x01', scope => 'tenant-a');
SELECT scope, key, state FROM public.idem_keys_parts ORDER BY scope, key;
ALTER TABLE public.idem_keys_parts DETACH PARTITION idempotency.keys;
DROP TABLE public.idem_keys_parts;
TRUNCATE idempotency.keys;
