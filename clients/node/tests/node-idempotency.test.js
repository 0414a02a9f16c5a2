'use strict';
// PostgresStorageAdapter under @node-idempotency/core (the library behind
// @node-idempotency/nestjs, /express and /fastify), from the npm registry.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = require('@node-idempotency/core');
const { PostgresStorageAdapter } = require('pg-idempotency/node-idempotency');
const { ClaimLostError } = require('pg-idempotency');
const { newPool, unique, sleep } = require('./helpers');

const pool = newPool();
test.after(() => pool.end());

// Returns a request as the plugins hand it to the library.
function request(key, body = { amount: 10 }, options = undefined) {
  return { headers: { 'idempotency-key': key }, path: '/payments', method: 'POST', body, options };
}

// Returns a rejection check for an IdempotencyError with this code.
function idempotencyError(code) {
  return (err) => err instanceof IdempotencyError && err.code === code;
}

test('the first request runs; its retry gets the stored response', async () => {
  const idem = new Idempotency(new PostgresStorageAdapter({ pool, scope: unique('ni') }));
  const req = request('k1');
  assert.equal(await idem.onRequest(req), undefined);
  const res = { body: { charge: 7 }, additional: { statusCode: 201 } };
  await idem.onResponse(req, res);
  assert.deepEqual(await idem.onRequest(req), res);
});

test('a retry while the first runs is REQUEST_IN_PROGRESS; with the wait strategy it gets the response', async () => {
  const idem = new Idempotency(new PostgresStorageAdapter({ pool, scope: unique('ni') }));
  const req = request('k1');
  await idem.onRequest(req);
  await assert.rejects(idem.onRequest(req), idempotencyError(IdempotencyErrorCodes.REQUEST_IN_PROGRESS));
  const waiting = idem.onRequest({ ...req, options: { inProgressStrategy: { wait: true, pollingIntervalMs: 20, maxWaitMs: 2000 } } });
  await sleep(100);
  await idem.onResponse(req, { body: 'done' });
  assert.deepEqual(await waiting, { body: 'done' });
});

test('another body under the same key is IDEMPOTENCY_FINGERPRINT_MISSMATCH', async () => {
  const idem = new Idempotency(new PostgresStorageAdapter({ pool, scope: unique('ni') }));
  await idem.onRequest(request('k1', { amount: 10 }));
  await idem.onResponse(request('k1', { amount: 10 }), { body: 'ok' });
  await assert.rejects(idem.onRequest(request('k1', { amount: 99 })),
    idempotencyError(IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH));
});

test('a crashed request frees its key when its lease ends, not after the whole TTL', async () => {
  const scope = unique('ni');
  const crashed = new Idempotency(new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  const req = request('k1');
  assert.equal(await crashed.onRequest(req), undefined); // and then the process dies
  const restarted = new Idempotency(new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  await assert.rejects(restarted.onRequest(req), idempotencyError(IdempotencyErrorCodes.REQUEST_IN_PROGRESS));
  await sleep(400);
  assert.equal(await restarted.onRequest(req), undefined);
});

test('an owner whose lease was taken over cannot store its response (ClaimLostError, IK001)', async () => {
  const scope = unique('ni');
  const slow = new Idempotency(new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  const retry = new Idempotency(new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  const req = request('k1');
  await slow.onRequest(req);
  await sleep(400);
  assert.equal(await retry.onRequest(req), undefined);
  await retry.onResponse(req, { body: 'from the retry' });
  await assert.rejects(slow.onResponse(req, { body: 'from the slow one' }), (err) => {
    assert.ok(err instanceof ClaimLostError);
    assert.equal(err.code, 'IK001');
    return true;
  });
  assert.deepEqual(await retry.onRequest(req), { body: 'from the retry' });
});

test('values read back as the library wrote them; errors are stored and replayed as the library expects', async () => {
  const scope = unique('ni');
  const adapter = new PostgresStorageAdapter({ pool, scope });
  const idem = new Idempotency(adapter);
  const req = request('k1', { a: 'a' }, { cacheKeyPrefix: 'tenant-1' });
  await idem.onRequest(req);
  const inProgress = JSON.parse(await adapter.get('tenant-1:POST:/payments:k1'));
  assert.equal(inProgress.status, 'IN_PROGRESS');
  assert.match(inProgress.fingerPrint, /^[0-9a-f]{64}$/);
  const res = { error: { message: 'unknown' }, additional: { statusCode: 500 } };
  await idem.onResponse(req, res);
  const stored = await adapter.get('tenant-1:POST:/payments:k1');
  assert.deepEqual(JSON.parse(stored), { status: 'COMPLETE', fingerPrint: inProgress.fingerPrint, response: res });
  assert.deepEqual(await idem.onRequest(req), res);
  const { rows } = await pool.query('SELECT status_code FROM idempotency.keys WHERE scope = $1', [scope]);
  assert.deepEqual(rows, [{ status_code: 500 }]);
  assert.equal(await adapter.get('nothing here'), undefined);
});

test('a request without a body, and keys longer than the extension takes', async () => {
  const adapter = new PostgresStorageAdapter({ pool, scope: unique('ni') });
  const idem = new Idempotency(adapter, { keyMaxLength: 1000 });
  const req = { ...request('k'.repeat(300)), body: undefined, path: `/${'p'.repeat(300)}` };
  assert.equal(await idem.onRequest(req), undefined);
  assert.deepEqual(JSON.parse(await adapter.get(`node-idempotency:POST:${req.path}:${'k'.repeat(300)}`)), { status: 'IN_PROGRESS' });
  await idem.onResponse(req, { body: 1 });
  assert.deepEqual(await idem.onRequest(req), { body: 1 });
});

test('set writes only through a claim this adapter holds, and never the library\'s own refusals', async () => {
  // The Fastify plugin calls onResponse for every answer it sends: replays, and its 409 and 422.
  const adapter = new PostgresStorageAdapter({ pool, scope: unique('ni') });
  const idem = new Idempotency(adapter);
  await adapter.set('never-claimed', JSON.stringify({ status: 'COMPLETE', response: { body: 1 } }), {});
  assert.equal(await adapter.get('never-claimed'), undefined);
  const req = request('k1');
  await idem.onRequest(req);
  const conflict = JSON.stringify({ statusCode: 409, code: 'REQUEST_IN_PROGRESS', message: 'outstanding' });
  await idem.onResponse(req, { error: conflict, additional: { statusCode: 409 } });
  assert.equal(JSON.parse(await adapter.get('node-idempotency:POST:/payments:k1')).status, 'IN_PROGRESS');
  await idem.onResponse(req, { body: 'the handler\'s', additional: { statusCode: 201 } });
  await idem.onResponse(req, { body: 'sent again by a replay', additional: { statusCode: 201 } });
  assert.deepEqual(await idem.onRequest(req), { body: 'the handler\'s', additional: { statusCode: 201 } });
});

test('the adapter refuses what is not the library\'s values', async () => {
  const adapter = new PostgresStorageAdapter({ pool, scope: unique('ni') });
  await assert.rejects(adapter.setIfNotExists('k', 'not json'), TypeError);
  await assert.rejects(adapter.setIfNotExists('k', '{"status":"COMPLETE"}'), TypeError);
  await assert.rejects(adapter.set('k', '{"status":"IN_PROGRESS"}', {}), TypeError);
  assert.throws(() => new PostgresStorageAdapter({}), TypeError);
});
