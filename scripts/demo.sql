-- The retried payment, in SQL.  Each step says what the HTTP layer would answer.
\set ON_ERROR_STOP on
\pset footer off
\pset null '-'
SET client_min_messages = warning;

CREATE EXTENSION idempotency;
-- The application's own table: the "charge" is a row here.
CREATE TABLE charges (id serial PRIMARY KEY, amount int NOT NULL);

\echo
\echo '1. POST /payments {"amount":10} with Idempotency-Key: order-42'
\echo '   claim() says "new": run the handler.'
SELECT idempotency.fingerprint('POST', '/payments', '{"amount":10}') AS fp \gset
SELECT outcome, fence, attempt FROM idempotency.claim('order-42', :'fp') \gset
SELECT :'outcome' AS outcome, :'attempt' AS attempt;
\echo '   The handler charges the card and stores its response in the same transaction:'
BEGIN;
INSERT INTO charges (amount) VALUES (10) RETURNING id AS charge_id \gset
SELECT idempotency.complete('order-42', :fence, 201,
       convert_to(format('{"charge":%s}', :charge_id), 'UTF8'),
       '{"Content-Type": "application/json"}') AS complete;
COMMIT;

\echo
\echo '2. The client timed out and retries: same key, same request.'
\echo '   claim() says "replay": send the stored response, byte for byte, with Idempotent-Replayed: true.'
SELECT outcome, status_code, headers, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('order-42', :'fp');
SELECT count(*) AS charges_made FROM charges;

\echo
\echo '3. The same key with a different body: "mismatch", answer 422.'
SELECT outcome, created_at IS NOT NULL AS first_request_seen
FROM idempotency.claim('order-42', idempotency.fingerprint('POST', '/payments', '{"amount":99}'));

\echo
\echo '4. A retry arrives while the first attempt is still running: "in_progress",'
\echo '   answer 409 with Retry-After: <retry_after>.'
SELECT idempotency.fingerprint('POST', '/payments', '{"amount":25}') AS fp2 \gset
SELECT fence AS fence2 FROM idempotency.claim('order-43', :'fp2', lease => '30s') \gset
SELECT outcome, retry_after FROM idempotency.claim('order-43', :'fp2');

\echo
\echo '5. The handler fails with a 503: complete() releases the key instead of storing it,'
\echo '   so the retry runs again.'
SELECT idempotency.complete('order-43', :fence2, 503, '{"error":"card network down"}') AS complete;
SELECT outcome, attempt FROM idempotency.claim('order-43', :'fp2', lease => '1s') \gset
SELECT :'outcome' AS outcome, :'attempt' AS attempt;
SELECT fence AS fence3 FROM idempotency.keys WHERE key = 'order-43' \gset

\echo
\echo '6. That owner crashes mid-request (its 1 s lease runs out) ...'
SELECT pg_sleep(1.2) \g /dev/null
\echo '   ... and the next retry takes over: "new", attempt 2, a larger fence.'
SELECT outcome, attempt, fence > :fence3 AS larger_fence
FROM idempotency.claim('order-43', :'fp2', lease => '30s');
\echo '   The crashed owner comes back and tries to store its response: refused with IK001,'
\echo '   and its transaction (with its business writes) rolls back.'
\set ON_ERROR_STOP off
BEGIN;
INSERT INTO charges (amount) VALUES (25);
SELECT idempotency.complete('order-43', :fence3, 201, '{"charge":"stale"}');
\echo '   SQLSTATE' :LAST_ERROR_SQLSTATE
ROLLBACK;
\set ON_ERROR_STOP on
SELECT count(*) AS charges_made FROM charges;

\echo
\echo 'The statistics of this demo:'
SELECT claims_new, claims_replay, claims_in_progress, claims_mismatch, takeovers,
       completes_stored, completes_released, fence_rejections, rows_total
FROM idempotency.stats;
