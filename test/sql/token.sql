-- claim's token (1.2): the same attempt asks again and is answered `new` again
CREATE EXTENSION IF NOT EXISTS idempotency;
SET idempotency.lease = '60s';
\set t1 '''00000000-0000-4000-8000-000000000001'''
\set t2 '''00000000-0000-4000-8000-000000000002'''
SELECT claims_resumed AS resumed_before FROM idempotency.stats \gset

-- the claim, then its token again: new, same fence and attempt, nothing written
SELECT fence AS f, attempt AS a FROM idempotency.claim('tk-1', '\x01', token => :t1) \gset
SELECT lease_expires_at AS lease_end, xmin AS row_xmin FROM idempotency.keys WHERE key = 'tk-1' \gset
SELECT outcome, fence = :f AS same_fence, attempt = :a AS same_attempt, attempt,
       recovery_point, retry_after, created_at IS NOT NULL AS has_created
FROM idempotency.claim('tk-1', '\x01', token => :t1);
SELECT lease_expires_at = :'lease_end' AS lease_not_renewed, xmin = :'row_xmin' AS row_not_written,
       token = :t1 AS token_kept
FROM idempotency.keys WHERE key = 'tk-1';
-- with wait too: answered at once
SELECT outcome, fence = :f AS same_fence FROM idempotency.claim('tk-1', '\x01', wait => '10s', token => :t1);

-- another token, none, or NULL: in progress, as before
SELECT outcome, fence, retry_after > 0 AS has_retry_after FROM idempotency.claim('tk-1', '\x01', token => :t2);
SELECT outcome, fence FROM idempotency.claim('tk-1', '\x01');
SELECT outcome, fence FROM idempotency.claim('tk-1', '\x01', token => NULL);
-- the same token with another request: mismatch
SELECT outcome, fence FROM idempotency.claim('tk-1', '\x02', token => :t1);
-- the same token in another scope meets another record: a new claim
SELECT outcome, fence <> :f AS other_fence FROM idempotency.claim('tk-1', '\x01', 'other', token => :t1);

-- a checkpoint's recovery point comes back with the answer
SELECT idempotency.checkpoint('tk-1', :f, 'charged', '{"charge": 7}');
SELECT outcome, fence = :f AS same_fence, recovery_point, recovery_state
FROM idempotency.claim('tk-1', '\x01', token => :t1);

-- complete clears the token; the token then finds the replay
SELECT idempotency.complete('tk-1', :f, 201, 'done');
SELECT token IS NULL AS token_cleared FROM idempotency.keys WHERE key = 'tk-1' AND scope = '';
SELECT outcome, status_code, body, fence FROM idempotency.claim('tk-1', '\x01', token => :t1);

-- a COMMIT whose answer was lost: complete committed -> replay
SELECT fence AS f FROM idempotency.claim('tk-commit', '\x01', token => :t1) \gset
BEGIN;
SELECT idempotency.complete('tk-commit', :f, 200, 'committed');
COMMIT;
SELECT outcome, status_code, body FROM idempotency.claim('tk-commit', '\x01', token => :t1);

-- ... rolled back -> new, with the same fence and attempt: run it again
SELECT fence AS f, attempt AS a FROM idempotency.claim('tk-rollback', '\x01', token => :t1) \gset
BEGIN;
SELECT idempotency.complete('tk-rollback', :f, 200, 'rolled back');
ROLLBACK;
SELECT outcome, fence = :f AS same_fence, attempt = :a AS same_attempt
FROM idempotency.claim('tk-rollback', '\x01', token => :t1);
SELECT idempotency.complete('tk-rollback', :f, 200, 'second run');

-- in one transaction, the claim's own record answers its token
BEGIN;
SELECT fence AS f FROM idempotency.claim('tk-txn', '\x01', token => :t1) \gset
SELECT outcome, fence = :f AS same_fence FROM idempotency.claim('tk-txn', '\x01', token => :t1);
ROLLBACK;
-- rolled back: the token finds nothing, a new claim with a new fence
SELECT outcome, fence <> :f AS new_fence FROM idempotency.claim('tk-txn', '\x01', token => :t1);

-- an ended lease is taken over, also by its own token: another claimer could
-- have taken it, so a new fence and attempt; the taker's token is the owner's
SELECT fence AS f FROM idempotency.claim('tk-lease', '\x01', lease => '1 millisecond', token => :t1) \gset
SELECT pg_sleep(0.01);
SELECT outcome, fence > :f AS new_fence, attempt FROM idempotency.claim('tk-lease', '\x01', token => :t1);
SELECT fence AS f FROM idempotency.keys WHERE key = 'tk-lease' \gset
SELECT outcome, fence = :f AS same_fence, attempt FROM idempotency.claim('tk-lease', '\x01', token => :t1);
-- taken over by another token: the old one is in progress now
UPDATE idempotency.keys SET lease_expires_at = now() - interval '1 second' WHERE key = 'tk-lease';
SELECT outcome, fence > :f AS new_fence, attempt FROM idempotency.claim('tk-lease', '\x01', token => :t2);
SELECT outcome FROM idempotency.claim('tk-lease', '\x01', token => :t1);
SELECT outcome, attempt FROM idempotency.claim('tk-lease', '\x01', token => :t2);
-- a takeover without a token leaves none
UPDATE idempotency.keys SET lease_expires_at = now() - interval '1 second' WHERE key = 'tk-lease';
SELECT outcome, attempt FROM idempotency.claim('tk-lease', '\x01');
SELECT token IS NULL AS no_token FROM idempotency.keys WHERE key = 'tk-lease';
SELECT outcome FROM idempotency.claim('tk-lease', '\x01', token => :t2);

-- an expired record made anew (reset) keeps the new claim's token
SELECT fence AS f FROM idempotency.claim('tk-reset', '\x01', lease => '1 millisecond',
                                         retention => '1 millisecond', token => :t1) \gset
SELECT pg_sleep(0.01);
SELECT outcome, fence > :f AS new_fence, attempt FROM idempotency.claim('tk-reset', '\x01', token => :t2);
SELECT outcome, attempt FROM idempotency.claim('tk-reset', '\x01', token => :t2);
SELECT outcome FROM idempotency.claim('tk-reset', '\x01', token => :t1);

-- released: the token finds nothing, a new claim
SELECT fence AS f FROM idempotency.claim('tk-release', '\x01', token => :t1) \gset
SELECT idempotency.release('tk-release', :f);
SELECT outcome, fence > :f AS new_fence FROM idempotency.claim('tk-release', '\x01', token => :t1);

-- the record of another role is not resumed, even by a role that sees it
CREATE ROLE idem_token_app;
GRANT USAGE ON SCHEMA idempotency TO idem_token_app;
SET ROLE idem_token_app;
SELECT outcome FROM idempotency.claim('tk-role', '\x01', token => :t1);
SELECT outcome FROM idempotency.claim('tk-role', '\x01', token => :t1);
RESET ROLE;
SELECT outcome FROM idempotency.claim('tk-role', '\x01', token => :t1);
DELETE FROM idempotency.keys WHERE key = 'tk-role';
REVOKE USAGE ON SCHEMA idempotency FROM idem_token_app;
DROP ROLE idem_token_app;

-- resumed claims are counted apart from new ones
SELECT claims_resumed - :resumed_before AS resumed FROM idempotency.stats;

-- a bad token is the type's error
SELECT outcome FROM idempotency.claim('tk-bad', '\x01', token => 'not-a-uuid');
