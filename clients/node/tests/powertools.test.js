'use strict';
// PostgresPersistenceLayer under @aws-lambda-powertools/idempotency, unchanged:
// makeIdempotent and the middy middleware makeHandlerIdempotent.

const test = require('node:test');
const assert = require('node:assert/strict');
const {
  makeIdempotent, IdempotencyConfig, IdempotencyAlreadyInProgressError, IdempotencyValidationError,
  IdempotencyPersistenceLayerError,
} = require('@aws-lambda-powertools/idempotency');
const { makeHandlerIdempotent } = require('@aws-lambda-powertools/idempotency/middleware');
const { PostgresPersistenceLayer } = require('pg-idempotency/powertools');
const { ClaimLostError } = require('pg-idempotency');
const { newPool, unique, sleep } = require('./helpers');

const pool = newPool();
test.after(() => pool.end());

// Returns the records of a scope, as the table holds them.
async function records(scope) {
  const { rows } = await pool.query(
    'SELECT key, state, status_code, convert_from(body, \'UTF8\') AS body FROM idempotency.keys WHERE scope = $1', [scope]);
  return rows;
}

// Returns a Lambda context whose remaining time is ms.
function lambdaContext(ms) {
  return { functionName: 'payments', awsRequestId: unique('req'), getRemainingTimeInMillis: () => ms };
}

// Wraps fn with makeIdempotent on a layer of its own (a Lambda environment) in scope.
function idempotent(fn, scope, config = {}) {
  const persistenceStore = new PostgresPersistenceLayer({ pool, scope });
  return makeIdempotent(fn, { persistenceStore, config: new IdempotencyConfig(config) });
}

test('makeIdempotent: the function runs once; the next call replays its result', async () => {
  const scope = unique('pt');
  let calls = 0;
  const charge = idempotent(async (event) => ({ charged: event.amount, call: ++calls }), scope);
  const first = await charge({ orderId: 'o1', amount: 10 });
  const again = await charge({ orderId: 'o1', amount: 10 });
  assert.deepEqual(first, { charged: 10, call: 1 });
  assert.deepEqual(again, first);
  assert.equal(calls, 1);
  const [record] = await records(scope);
  assert.equal(record.state, 'completed');
  assert.deepEqual(JSON.parse(record.body), first);
  assert.deepEqual(await charge({ orderId: 'o2', amount: 10 }), { charged: 10, call: 2 });
});

test('makeIdempotent: a result of undefined or null replays as such', async () => {
  const scope = unique('pt');
  let calls = 0;
  const nothing = idempotent(async () => { calls++; }, scope);
  assert.equal(await nothing({ id: 1 }), undefined);
  assert.equal(await nothing({ id: 1 }), undefined);
  const nil = idempotent(async () => { calls++; return null; }, scope);
  assert.equal(await nil({ id: 2 }), null);
  assert.equal(await nil({ id: 2 }), null);
  assert.equal(calls, 2);
});

test('makeIdempotent: a concurrent call gets IdempotencyAlreadyInProgressError', async () => {
  const scope = unique('pt');
  let calls = 0;
  const slow = idempotent(async () => { calls++; await sleep(400); return 'done'; }, scope);
  const results = await Promise.allSettled([slow({ id: 1 }), sleep(100).then(() => slow({ id: 1 }))]);
  assert.equal(results[0].value, 'done');
  assert.ok(results[1].reason instanceof IdempotencyAlreadyInProgressError, String(results[1].reason));
  assert.equal(calls, 1);
});

test('payload validation: another payload under the same key is IdempotencyValidationError', async () => {
  const scope = unique('pt');
  const config = { eventKeyJmesPath: 'orderId', payloadValidationJmesPath: 'amount' };
  const charge = idempotent(async (event) => ({ charged: event.amount }), scope, config);
  assert.deepEqual(await charge({ orderId: 'o1', amount: 10 }), { charged: 10 });
  await assert.rejects(charge({ orderId: 'o1', amount: 99 }), IdempotencyValidationError);
  assert.deepEqual(await charge({ orderId: 'o1', amount: 10 }), { charged: 10 });
  // Also while the first call still runs.
  const slow = idempotent(async (event) => { await sleep(300); return event.amount; }, scope, config);
  const running = slow({ orderId: 'o2', amount: 1 });
  await sleep(100);
  await assert.rejects(slow({ orderId: 'o2', amount: 2 }), IdempotencyValidationError);
  assert.equal(await running, 1);
});

test('a function that throws releases the record: the next call runs it again', async () => {
  const scope = unique('pt');
  let calls = 0;
  const flaky = idempotent(async () => {
    if (++calls === 1) throw new Error('downstream failed');
    return 'ok';
  }, scope);
  await assert.rejects(flaky({ id: 1 }), /downstream failed/);
  assert.deepEqual(await records(scope), []);
  assert.equal(await flaky({ id: 1 }), 'ok');
  assert.equal(calls, 2);
});

test('a call whose remaining time ran out is taken over; its late save is fenced out (IK001)', async () => {
  const scope = unique('pt');
  const config = { eventKeyJmesPath: 'orderId' };
  // Two Lambda environments, each with its own layer instance.
  const timedOut = idempotent(async (event) => { await sleep(event.workMs); return 'first'; }, scope, config);
  const retry = idempotent(async () => 'retry', scope, config);
  const first = timedOut({ orderId: 'o1', workMs: 900 }, lambdaContext(300));
  await sleep(100);
  await assert.rejects(retry({ orderId: 'o1' }, lambdaContext(5000)), IdempotencyAlreadyInProgressError);
  await sleep(400);
  assert.equal(await retry({ orderId: 'o1' }, lambdaContext(5000)), 'retry');
  await assert.rejects(first, (err) => {
    assert.ok(err instanceof IdempotencyPersistenceLayerError, String(err));
    assert.ok(err.cause instanceof ClaimLostError, String(err.cause));
    assert.equal(err.cause.code, 'IK001');
    return true;
  });
  assert.equal(await retry({ orderId: 'o1' }, lambdaContext(5000)), 'retry');
  const [record] = await records(scope);
  assert.equal(JSON.parse(record.body), 'retry');
});

test('makeHandlerIdempotent (middy): runs once and replays; a thrown handler releases', async () => {
  const { default: middy } = await import('@middy/core');
  const scope = unique('pt');
  let calls = 0;
  const persistenceStore = new PostgresPersistenceLayer({ pool, scope });
  const handler = middy(async (event) => {
    calls++;
    if (event.fail) throw new Error('failed');
    return { statusCode: 201, body: JSON.stringify({ charge: calls }) };
  }).use(makeHandlerIdempotent({ persistenceStore, config: new IdempotencyConfig({ eventKeyJmesPath: 'id' }) }));
  const first = await handler({ id: 'a' }, lambdaContext(5000));
  assert.deepEqual(await handler({ id: 'a' }, lambdaContext(5000)), first);
  assert.equal(calls, 1);
  await assert.rejects(handler({ id: 'b', fail: true }, lambdaContext(5000)), /failed/);
  assert.equal((await records(scope)).length, 1);
  await assert.rejects(handler({ id: 'b', fail: true }, lambdaContext(5000)), /failed/);
  assert.equal(calls, 3);
});

test('getRecord reads a stored record back; a scope keeps layers apart', async () => {
  const scope = unique('pt');
  const persistenceStore = new PostgresPersistenceLayer({ pool, scope });
  const config = new IdempotencyConfig({ payloadValidationJmesPath: 'amount' });
  const charge = makeIdempotent(async (event) => event.amount * 2, { persistenceStore, config });
  await charge({ amount: 21 });
  const record = await persistenceStore.getRecord({ amount: 21 });
  assert.equal(record.getStatus(), 'COMPLETED');
  assert.equal(record.getResponse(), 42);
  const elsewhere = idempotent(async () => 'other scope', unique('pt'));
  assert.equal(await elsewhere({ amount: 21 }), 'other scope');
});

test('the layer refuses a missing pool', () => {
  assert.throws(() => new PostgresPersistenceLayer({}), TypeError);
  assert.throws(() => new PostgresPersistenceLayer({ pool, leaseMs: 0 }), TypeError);
});
