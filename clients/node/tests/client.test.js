'use strict';
// The typed client: claim, complete, release, extend, checkpoint, lookup.

const test = require('node:test');
const assert = require('node:assert/strict');
const { IdempotencyClient, ClaimLostError, fingerprint } = require('pg-idempotency');
const { newPool, unique, sleep } = require('./helpers');

const pool = newPool();
test.after(() => pool.end());

// Returns a client on its own scope, so that tests never share records.
function newClient(options = {}) {
  return new IdempotencyClient(pool, { scope: unique('client'), ...options });
}

const FP = fingerprint('POST', '/payments', '{"amount":10}');
const OTHER_FP = fingerprint('POST', '/payments', '{"amount":99}');

test('claim: new, then complete stores the response that the next claim replays', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP);
  assert.equal(first.outcome, 'new');
  assert.equal(first.attempt, 1);
  assert.match(first.fence, /^\d+$/);
  const body = Buffer.from([0, 1, 2, 255]);
  assert.equal(await idem.complete('k', first.fence, 201, body, { 'content-type': 'application/octet-stream' }), 'stored');
  const again = await idem.claim('k', FP);
  assert.equal(again.outcome, 'replay');
  assert.equal(again.statusCode, 201);
  assert.deepEqual(again.body, body);
  assert.deepEqual(again.headers, { 'content-type': 'application/octet-stream' });
  assert.ok(again.createdAt instanceof Date);
  assert.equal(again.fence, null);
});

test('claim: mismatch for another fingerprint, in_progress with retryAfter while the lease lives', async () => {
  const idem = newClient({ lease: '30 seconds' });
  await idem.claim('k', FP);
  const busy = await idem.claim('k', FP);
  assert.equal(busy.outcome, 'in_progress');
  assert.ok(busy.retryAfter >= 29 && busy.retryAfter <= 30, `retryAfter ${busy.retryAfter}`);
  assert.equal((await idem.claim('k', OTHER_FP)).outcome, 'mismatch');
});

test('claim: a lease given in milliseconds ends, and the next claim takes over with a larger fence', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP, { lease: 200 });
  await sleep(300);
  const second = await idem.claim('k', FP);
  assert.equal(second.outcome, 'new');
  assert.equal(second.attempt, 2);
  assert.ok(BigInt(second.fence) > BigInt(first.fence));
  await assert.rejects(idem.complete('k', first.fence, 200), (err) => {
    assert.ok(err instanceof ClaimLostError);
    assert.equal(err.code, 'IK001');
    assert.equal(err.cause.code, 'IK001');
    return true;
  });
  assert.equal(await idem.complete('k', second.fence, 200, 'ok'), 'stored');
});

test('release frees the key; a lost fence is not released', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP);
  assert.equal(await idem.release('k', first.fence), true);
  assert.equal(await idem.lookup('k'), null);
  const second = await idem.claim('k', FP);
  assert.equal(second.outcome, 'new');
  assert.equal(await idem.release('k', first.fence), false);
});

test('extend renews the lease; checkpoint saves progress a takeover gets back', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP, { lease: 100 });
  const end = await idem.extend('k', first.fence, { lease: '0.5 seconds' });
  assert.ok(end instanceof Date && end.getTime() > Date.now() + 300, `lease ends at ${end}`);
  await idem.checkpoint('k', first.fence, 'charged', { charge: 7 });
  const record = await idem.lookup('k');
  assert.equal(record.recoveryPoint, 'charged');
  assert.deepEqual(record.recoveryState, { charge: 7 });
  assert.equal((await idem.claim('k', FP)).outcome, 'in_progress');
  await sleep(600);
  const taken = await idem.claim('k', FP);
  assert.equal(taken.outcome, 'new');
  assert.equal(taken.recoveryPoint, 'charged');
  assert.deepEqual(taken.recoveryState, { charge: 7 });
  await assert.rejects(idem.extend('k', first.fence), ClaimLostError);
  await assert.rejects(idem.checkpoint('k', first.fence, 'x'), ClaimLostError);
});

test('lookup shows the record without its fence', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP);
  const record = await idem.lookup('k');
  assert.equal(record.state, 'in_progress');
  assert.equal(record.key, 'k');
  assert.deepEqual(record.fingerprint, FP);
  assert.equal(record.attempt, 1);
  assert.ok(record.leaseExpiresAt instanceof Date);
  assert.equal('fence' in record, false);
  await idem.complete('k', first.fence, 200, 'done');
  const done = await idem.lookup('k');
  assert.equal(done.state, 'completed');
  assert.equal(done.body.toString(), 'done');
  assert.equal(done.statusCode, 200);
});

test('complete of a 5xx releases, unless storeServerErrors keeps it', async () => {
  const idem = newClient();
  const first = await idem.claim('a', FP);
  assert.equal(await idem.complete('a', first.fence, 503, 'down'), 'released');
  assert.equal(await idem.lookup('a'), null);
  const second = await idem.claim('b', FP);
  assert.equal(await idem.complete('b', second.fence, 503, 'down', null, { storeServerErrors: true }), 'stored');
  assert.equal((await idem.claim('b', FP)).statusCode, 503);
  // The setting was for that call only.
  const third = await idem.claim('c', FP);
  assert.equal(await idem.complete('c', third.fence, 500, 'x'), 'released');
});

test('complete in the caller\'s transaction rolls back with it', async () => {
  const idem = newClient();
  const first = await idem.claim('k', FP);
  const db = await pool.connect();
  try {
    await db.query('BEGIN');
    assert.equal(await idem.complete('k', first.fence, 201, 'x', null, { db }), 'stored');
    await db.query('ROLLBACK');
  } finally {
    db.release();
  }
  assert.equal((await idem.lookup('k')).state, 'in_progress');
});

test('scopes keep keys apart; a per-call scope overrides the default', async () => {
  const idem = newClient();
  const scope = unique('other');
  await idem.claim('k', FP);
  assert.equal((await idem.claim('k', OTHER_FP, { scope })).outcome, 'new');
  assert.equal((await idem.lookup('k', { scope })).scope, scope);
});

test('bad input is a clear error: the extension\'s SQLSTATE, or a TypeError', async () => {
  const idem = newClient();
  await assert.rejects(idem.claim('', FP), { code: '22023' });
  await assert.rejects(idem.claim('k'.repeat(256), FP), { code: '22023' });
  await assert.rejects(idem.claim('k', FP, { lease: -5 }), { code: '22023' });
  await assert.rejects(idem.claim('k', null), { code: '22004' });
  await assert.rejects(idem.claim('k', FP, { lease: Infinity }), TypeError);
  assert.throws(() => new IdempotencyClient({}), TypeError);
});
