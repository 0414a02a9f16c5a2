-- claim: every outcome, in the order the design decides them
CREATE EXTENSION IF NOT EXISTS idempotency;
SET idempotency.lease = '60s';

-- new: no record yet
SELECT outcome, fence > 0 AS has_fence, attempt, retry_after, created_at IS NOT NULL AS has_created
FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":10}'))
\gset c1_
SELECT :'c1_outcome' AS outcome, :'c1_has_fence' AS has_fence, :'c1_attempt' AS attempt;
SELECT fence AS fence1 FROM idempotency.keys WHERE key = 'pay-1' \gset

-- in_progress: the owner holds a live lease; retry_after is whole seconds, at least 1
SELECT outcome, fence, attempt, retry_after BETWEEN 1 AND 60 AS retry_after_ok
FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":10}'));

-- mismatch: another request under the same key, also while in progress
SELECT outcome, fence, created_at IS NOT NULL AS has_created
FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":99}'));

-- complete with a binary body containing zero bytes; replay gives it back byte for byte
SELECT idempotency.complete('pay-1', :fence1, 201, '\x7b00ff00017d'::bytea,
                            '{"Content-Type": "application/json"}');
SELECT outcome, fence, status_code, headers, body, body = '\x7b00ff00017d'::bytea AS exact,
       length(body) AS len
FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":10}'));

-- mismatch wins over replay: the key belongs to its first request
SELECT outcome, status_code, body
FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":99}'));

-- a completed record is immutable: complete, release, extend, checkpoint with its fence fail
SELECT idempotency.complete('pay-1', :fence1, 200, 'other');
SELECT idempotency.release('pay-1', :fence1);
SELECT idempotency.extend('pay-1', :fence1);
SELECT idempotency.checkpoint('pay-1', :fence1, 'step');
SELECT state, status_code, body FROM idempotency.keys WHERE key = 'pay-1';

-- replays and mismatches write nothing: the row version is unchanged
SELECT xmin AS xmin_before FROM idempotency.keys WHERE key = 'pay-1' \gset
SELECT outcome FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":10}'));
SELECT outcome FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":99}'));
SELECT xmin = :'xmin_before' AS unchanged FROM idempotency.keys WHERE key = 'pay-1';

-- takeover: the owner's lease ended; new, attempt 2, larger fence, recovery point kept
SELECT fence AS f1 FROM idempotency.claim('job-1', '\x01', lease => '50 milliseconds') \gset
SELECT idempotency.checkpoint('job-1', :f1, 'charged', '{"charge_id": 7}');
SELECT pg_sleep(0.2);
SELECT outcome, fence > :f1 AS larger_fence, attempt, recovery_point, recovery_state
FROM idempotency.claim('job-1', '\x01', lease => '60s');
SELECT fence AS f2 FROM idempotency.keys WHERE key = 'job-1' \gset
-- the old owner is fenced out: IK001, and nothing changes
SELECT idempotency.complete('job-1', :f1, 200, 'stale');
SELECT idempotency.extend('job-1', :f1);
SELECT idempotency.checkpoint('job-1', :f1, 'stale');
SELECT idempotency.release('job-1', :f1);
SELECT state, fence = :f2 AS new_owner, recovery_point FROM idempotency.keys WHERE key = 'job-1';
-- the new owner completes
SELECT idempotency.complete('job-1', :f2, 200, 'fresh');
SELECT outcome, attempt, body FROM idempotency.claim('job-1', '\x01');

-- a taken-over, extended or checkpointed lease moves the record's expiry as
-- far as its own end: the record does not expire under its owner, and a
-- response stored at the lease's end is kept (retention - lease) after it
SELECT fence AS f12 FROM idempotency.claim('life-1', '\x0d', lease => '100 milliseconds',
                                           retention => '1s') \gset
SELECT pg_sleep(0.15);
SELECT outcome, attempt, fence AS f13 FROM idempotency.claim('life-1', '\x0d', lease => '10 min') \gset
SELECT :'outcome' AS outcome, :attempt AS attempt;
SELECT expires_at - lease_expires_at >= '900 milliseconds' AS margin_kept
FROM idempotency.keys WHERE key = 'life-1';
SELECT idempotency.complete('life-1', :f13, 201, 'late');
SELECT expires_at > completed_at + '9 minutes' AS kept_after_completion
FROM idempotency.keys WHERE key = 'life-1';
SELECT fence AS f14 FROM idempotency.claim('life-2', '\x0e', lease => '1s', retention => '1s') \gset
SELECT idempotency.extend('life-2', :f14, '1 hour') IS NOT NULL AS extended;
SELECT expires_at >= lease_expires_at AS expires_after_lease FROM idempotency.keys WHERE key = 'life-2';
SELECT fence AS f15 FROM idempotency.claim('life-3', '\x0f', lease => '100 milliseconds',
                                           retention => '100 milliseconds') \gset
SELECT idempotency.checkpoint('life-3', :f15, 'step-1');
SELECT expires_at >= lease_expires_at AS expires_after_lease FROM idempotency.keys WHERE key = 'life-3';
-- an owner whose record expired (lease and retention ended) has lost it, as
-- to claim and reap: IK001, nothing stored
SELECT fence AS f16 FROM idempotency.claim('life-4', '\x10', lease => '10 milliseconds',
                                           retention => '10 milliseconds') \gset
SELECT pg_sleep(0.05);
SELECT idempotency.complete('life-4', :f16, 201, 'too late');
SELECT idempotency.extend('life-4', :f16);
SELECT idempotency.checkpoint('life-4', :f16, 'too late');
SELECT state, body FROM idempotency.keys WHERE key = 'life-4';

-- a takeover with a different fingerprint is still a mismatch
SELECT fence AS f3 FROM idempotency.claim('job-2', '\x02', lease => '10 milliseconds') \gset
SELECT pg_sleep(0.05);
SELECT outcome FROM idempotency.claim('job-2', '\x03');
SELECT fence = :f3 AS same_owner FROM idempotency.keys WHERE key = 'job-2';

-- an expired record counts as absent: new, attempt 1, any fingerprint
SELECT fence AS f4 FROM idempotency.claim('old-1', '\x04', lease => '500 milliseconds',
                                          retention => '500 milliseconds') \gset
SELECT idempotency.complete('old-1', :f4, 200, 'old');
SELECT pg_sleep(0.6);
SELECT outcome, fence > :f4 AS larger_fence, attempt, recovery_point
FROM idempotency.claim('old-1', '\x05');
SELECT state, body IS NULL AS body_cleared, fingerprint FROM idempotency.keys WHERE key = 'old-1';

-- an expired in_progress record is absent only once its lease has ended too
-- (a lease extended past the retention, which moves the expiry with it)
SELECT fence AS f5 FROM idempotency.claim('old-2', '\x06', lease => '500 milliseconds',
                                          retention => '500 milliseconds') \gset
SELECT idempotency.extend('old-2', :f5, '60s') > clock_timestamp() AS extended;
SELECT pg_sleep(0.6);
SELECT outcome FROM idempotency.claim('old-2', '\x07');
SELECT outcome FROM idempotency.claim('old-2', '\x06');

-- release: the next retry runs again, with a larger fence
SELECT fence AS f6 FROM idempotency.claim('rel-1', '\x08') \gset
SELECT idempotency.release('rel-1', :f6);
SELECT idempotency.release('rel-1', :f6);
SELECT outcome, fence > :f6 AS larger_fence, attempt FROM idempotency.claim('rel-1', '\x08');

-- 5xx: released by default, so the retry runs again
SELECT fence AS f7 FROM idempotency.claim('err-1', '\x09') \gset
SELECT idempotency.complete('err-1', :f7, 503, 'unavailable');
SELECT outcome, attempt FROM idempotency.claim('err-1', '\x09');
SELECT fence AS f8 FROM idempotency.keys WHERE key = 'err-1' \gset
-- with store_server_errors on, a 5xx is stored and replayed
SET idempotency.store_server_errors = on;
SELECT idempotency.complete('err-1', :f8, 500, 'boom');
RESET idempotency.store_server_errors;
SELECT outcome, status_code, body FROM idempotency.claim('err-1', '\x09');

-- extend renews the lease by the claim's own length, or by the given one
SELECT fence AS f9 FROM idempotency.claim('ext-1', '\x0a', lease => '2s') \gset
SELECT idempotency.extend('ext-1', :f9) BETWEEN now() + '1s' AND clock_timestamp() + '2s' AS own_lease;
SELECT idempotency.extend('ext-1', :f9, '1 hour') > clock_timestamp() + '59 minutes' AS given_lease;
SELECT lease FROM idempotency.keys WHERE key = 'ext-1';
-- neither extend nor checkpoint ever shortens a lease
SELECT idempotency.extend('ext-1', :f9, '1 second') > clock_timestamp() + '59 minutes' AS not_shortened;
SELECT idempotency.checkpoint('ext-1', :f9, 'step-2');
SELECT lease_expires_at > clock_timestamp() + '59 minutes' AS not_shortened,
       recovery_point, recovery_state
FROM idempotency.keys WHERE key = 'ext-1';
-- checkpoint renews the lease by the claim's own length
SELECT fence AS f11 FROM idempotency.claim('ext-2', '\x0c', lease => '2s') \gset
SELECT lease_expires_at AS l0 FROM idempotency.keys WHERE key = 'ext-2' \gset
SELECT pg_sleep(0.1);
SELECT idempotency.checkpoint('ext-2', :f11, 'step-1', '{"n": 1}');
SELECT lease_expires_at > :'l0' AS renewed, lease_expires_at <= clock_timestamp() + '2s' AS by_own_lease,
       recovery_point, recovery_state
FROM idempotency.keys WHERE key = 'ext-2';

-- lookup shows the record as claim sees it, without the fence
SELECT key, state, attempt, status_code, body FROM idempotency.lookup('job-1');
SELECT count(*) FROM idempotency.lookup('no-such-key');
SELECT count(*) FROM idempotency.lookup('old-2');
SELECT * FROM idempotency.lookup('job-1') WHERE false;

-- lookup works in a read-only transaction; claim and the other writers raise 25006 there
BEGIN READ ONLY;
SELECT key, state FROM idempotency.lookup('pay-1');
SELECT outcome FROM idempotency.claim('pay-1', idempotency.fingerprint('POST', '/payments', '{"amount":10}'));
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.complete('ext-1', :f9, 200);
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.release('ext-1', :f9);
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.extend('ext-1', :f9);
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.checkpoint('ext-1', :f9, 'x');
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.reap();
ROLLBACK;

-- wait: an in_progress answer waits up to that long, then answers in_progress
SELECT outcome, retry_after >= 1 AS retry_after_ok
FROM idempotency.claim('ext-1', '\x0a', wait => '20 milliseconds');
-- under REPEATABLE READ the snapshot cannot see the owner finish: no waiting
-- (the statement_timeout would cancel a claim that waited)
BEGIN ISOLATION LEVEL REPEATABLE READ;
SET LOCAL statement_timeout = '1s';
SELECT outcome FROM idempotency.claim('ext-1', '\x0a', wait => '10s');
COMMIT;
-- wait until the lease ends: then it is a takeover
SELECT fence AS f10 FROM idempotency.claim('wait-1', '\x0b', lease => '100 milliseconds') \gset
SELECT outcome, attempt FROM idempotency.claim('wait-1', '\x0b', wait => '10s');

-- the fences handed out were all different and increasing
SELECT :f1 < :f2 AND :f2 < :f3 AND :f3 < :f4 AND :f4 < :f6 AND :f6 < :f7 AND :f7 < :f8
       AND :f8 < :f9 AND :f9 < :f11 AND :f11 < :f10 AS fences_increase;

-- two claims of one key in one statement: the second sees the first's insert
SELECT (SELECT outcome FROM idempotency.claim('same-stmt', '\x0d')) AS first,
       (SELECT outcome FROM idempotency.claim('same-stmt', '\x0d')) AS second;
-- and in one transaction, the claim sees its own complete
BEGIN;
SELECT fence AS f12 FROM idempotency.claim('same-txn', '\x0e') \gset
SELECT idempotency.complete('same-txn', :f12, 200, 'mine');
SELECT outcome, body FROM idempotency.claim('same-txn', '\x0e');
COMMIT;
