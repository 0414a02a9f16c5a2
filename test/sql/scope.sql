-- scopes: keys from different scopes never meet
CREATE EXTENSION IF NOT EXISTS idempotency;

SELECT outcome FROM idempotency.claim('order-1', '\x01', scope => 'acct_1');
SELECT outcome FROM idempotency.claim('order-1', '\x02', scope => 'acct_2');
SELECT outcome FROM idempotency.claim('order-1', '\x03');
SELECT scope, key, fingerprint FROM idempotency.keys WHERE key = 'order-1' ORDER BY scope;

-- SET LOCAL idempotency.scope sets the default for one transaction
BEGIN;
SET LOCAL idempotency.scope = 'acct_1';
SELECT outcome FROM idempotency.claim('order-1', '\x01');
SELECT outcome FROM idempotency.claim('order-1', '\x02');
SELECT fence AS f FROM idempotency.keys WHERE scope = 'acct_1' AND key = 'order-1' \gset
SELECT idempotency.complete('order-1', :f, 200, 'acct 1 response');
SELECT outcome, body FROM idempotency.claim('order-1', '\x01');
SELECT key, scope, body FROM idempotency.lookup('order-1');
COMMIT;
SHOW idempotency.scope;

-- another scope never sees acct_1's response
SELECT outcome, body FROM idempotency.claim('order-1', '\x01', scope => 'acct_3');
-- an explicit argument wins over the setting
SET idempotency.scope = 'acct_2';
SELECT outcome, body FROM idempotency.claim('order-1', '\x01', scope => 'acct_1');
SELECT count(*) FROM idempotency.lookup('order-1', scope => 'acct_9');
-- fencing is per scope: acct_2's fence does not complete acct_1's record
SELECT fence AS f2 FROM idempotency.keys WHERE scope = 'acct_2' AND key = 'order-1' \gset
SELECT idempotency.complete('order-1', :f2, 200, 'x', scope => 'acct_3');
RESET idempotency.scope;
