'use strict';
// The fingerprint computed in Node equals idempotency.fingerprint() in the database.

const test = require('node:test');
const assert = require('node:assert/strict');
const { fingerprint } = require('pg-idempotency');
const { newPool } = require('./helpers');

const pool = newPool();
test.after(() => pool.end());

// Returns the database's fingerprint of the same parts.
async function inDatabase(method, path, body, query) {
  const { rows } = await pool.query('SELECT idempotency.fingerprint($1, $2, $3, $4) AS fp',
    [method, path, body === null ? null : Buffer.from(body), query]);
  return rows[0].fp;
}

const CASES = [
  ['a JSON body, no query', 'POST', '/payments', '{"amount":10}', null],
  ['a NULL body and query', 'POST', '/payments', null, null],
  ['an empty body and query', 'POST', '/payments', '', ''],
  ['a NULL body, a query', 'PATCH', '/orders/7', null, 'expand=items&x=%20'],
  ['binary bytes', 'POST', '/upload', Buffer.from([0, 255, 1, 128, 10, 13, 0]), null],
  ['a lower-case method', 'post', '/payments', '{"amount":10}', null],
  ['a mixed-case method', 'PaTcH', '/p', 'x', 'q=1'],
  ['non-ASCII text', 'POST', '/café/ü', 'prix: 10 €', 'q=é'],
  ['a non-ASCII method (only ASCII is upper-cased)', 'pöst', '/', null, null],
  ['an empty path', 'POST', '', null, null],
  ['a large body', 'POST', '/bulk', Buffer.alloc(300000, 7), null],
];

for (const [name, method, path, body, query] of CASES) {
  test(`fingerprint equals the database's: ${name}`, async () => {
    const ours = fingerprint(method, path, body, query);
    assert.equal(ours.length, 32);
    assert.deepEqual(ours, await inDatabase(method, path, body, query));
  });
}

test('the parts are unambiguous: a NULL body differs from an empty one, (a, bc) from (ab, c)', () => {
  assert.notDeepEqual(fingerprint('POST', '/', null), fingerprint('POST', '/', ''));
  assert.notDeepEqual(fingerprint('POST', '/', null, null), fingerprint('POST', '/', null, ''));
  assert.notDeepEqual(fingerprint('POST', '/a', 'bc'), fingerprint('POST', '/ab', 'c'));
  assert.deepEqual(fingerprint('post', '/', 'x'), fingerprint('POST', '/', 'x'));
});

test('fingerprint refuses a missing method or path and a body that is not bytes', () => {
  assert.throws(() => fingerprint(null, '/'), TypeError);
  assert.throws(() => fingerprint('POST', undefined), TypeError);
  assert.throws(() => fingerprint('POST', '/', { amount: 1 }), TypeError);
});

test('without crypto.hash (Node before 20.12) the fingerprints are the same', async () => {
  const crypto = require('node:crypto');
  const file = require('node:path').join(require.resolve('pg-idempotency'), '..', 'lib', 'fingerprint.js');
  const oneShot = crypto.hash;
  delete require.cache[file];
  crypto.hash = undefined;
  try {
    const older = require(file).fingerprint;
    for (const [, method, path, body, query] of CASES)
      assert.deepEqual(older(method, path, body, query), await inDatabase(method, path, body, query));
  } finally {
    crypto.hash = oneShot;
    delete require.cache[file];
  }
});
