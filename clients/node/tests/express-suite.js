'use strict';
// The Express middleware against docs/http-contract.md, on a real database:
// the tests of one mode (two transactions, the default, or one; prepared
// statements or not), which express*.test.js run.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { Pool } = require('pg');
const { idempotency, IdempotencyClient } = require('pg-idempotency');
const { newPool, unique, sleep, listen, send, scopeOf } = require('./helpers');

module.exports = function expressSuite(mode) {
const oneTransaction = Boolean(mode.oneTransaction);
const pool = newPool();
const idem = new IdempotencyClient(pool);
// Per mode: the files run at the same time, in separate processes.
const suffix = `${oneTransaction ? '_one' : ''}${mode.prepare ? '_prepared' : ''}`;
const TABLE = `pg_idempotency_test_charges${suffix}`;
let server;
// Tests of one mode only.
const twoTransactionsOnly = oneTransaction ? () => {} : test;
const oneTransactionOnly = oneTransaction ? test : () => {};

// Returns an app with the middleware (options) and the routes the tests use.
function makeApp(db, options = {}) {
  const app = express();
  app.get('/charges/count', async (req, res) => {
    const { rows } = await db.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [req.query.tag]);
    res.json(rows[0]);
  });
  app.use(idempotency(db, { ...mode, ...options }));
  // Inserts a charge; body: tag, optional delayMs, status (default 201).
  app.post('/charges', async (req, res) => {
    const { tag, delayMs = 0, status = 201 } = req.body;
    if (delayMs) await sleep(delayMs);
    const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [tag]);
    res.status(status).set('Location', `/charges/${rows[0].id}`).set('X-Not-Stored', 'x')
      .json({ charge: Number(rows[0].id), tag });
  });
  app.post('/throws', async (req) => {
    await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1)`, [req.body.tag]);
    throw new Error('the handler failed');
  });
  app.post('/binary', (req, res) => {
    res.type('application/octet-stream').send(Buffer.from([0, 255, 13, 10, 128, req.rawBody.length]));
  });
  app.post('/echo', (req, res) => res.json({ body: req.body ?? null, raw: req.rawBody.toString('base64') }));
  app.put('/echo', (req, res) => res.json({ unguarded: true }));
  return app;
}

test.before(async () => {
  await pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`);
  server = await listen(makeApp(pool));
});
test.after(async () => {
  await server.close();
  await pool.end();
});

// Posts JSON as caller auth with Idempotency-Key field values keys (none when empty).
function post(path, body, { auth = 'Bearer alice', keys = [], url = server.url, headers = [] } = {}) {
  return send(url, {
    path, body: typeof body === 'string' ? body : JSON.stringify(body),
    headers: [['Content-Type', 'application/json'], ['Authorization', auth],
      ...keys.map((k) => ['Idempotency-Key', k]), ...headers],
  });
}

// Returns how many charges carry tag.
async function charges(tag) {
  const { rows } = await pool.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [tag]);
  return rows[0].n;
}

// Asserts that res is an RFC 9457 problem with this status and code.
function assertProblem(res, status, code) {
  assert.equal(res.status, status, res.body.toString());
  assert.match(res.headers['content-type'], /^application\/problem\+json/);
  const p = res.json();
  assert.equal(p.type, 'about:blank');
  assert.equal(p.title, { 400: 'Bad Request', 409: 'Conflict', 422: 'Unprocessable Content', 500: 'Internal Server Error', 503: 'Service Unavailable' }[status]);
  assert.equal(p.status, status);
  assert.equal(typeof p.detail, 'string');
  assert.ok(p.detail.length > 0);
  assert.equal(p.code, code);
}

test('a retry replays the first response byte for byte, marked, with the stored headers only', async () => {
  const tag = unique('replay');
  const key = unique('k');
  const first = await post('/charges', { tag }, { keys: [`"${key}"`] });
  assert.equal(first.status, 201);
  assert.equal(first.headers['idempotent-replayed'], undefined);
  const again = await post('/charges', { tag }, { keys: [`"${key}"`] });
  assert.equal(again.status, 201);
  assert.equal(again.headers['idempotent-replayed'], 'true');
  assert.deepEqual(again.body, first.body);
  assert.equal(again.headers['content-type'], first.headers['content-type']);
  assert.equal(again.headers.location, first.headers.location);
  assert.equal(again.headers['x-not-stored'], undefined);
  assert.equal(await charges(tag), 1);
});

// A redact option: stores the charge as "redacted" and one header of its own; notes what it got.
function redactCharge(seen) {
  return (stored) => {
    seen.push(stored);
    const body = JSON.parse(stored.body.toString());
    return { status: stored.status, headers: { 'x-redacted': 'yes' }, body: JSON.stringify({ ...body, charge: 'redacted' }) };
  };
}

test('redact: the live response is the handler\'s, complete stores what redact returns, a replay sends it', async () => {
  const seen = [];
  const app = await listen(makeApp(pool, { redact: redactCharge(seen) }));
  try {
    const tag = unique('redact');
    const key = unique('k');
    const first = await post('/charges', { tag }, { keys: [key], url: app.url });
    assert.equal(first.status, 201);
    assert.equal(typeof first.json().charge, 'number');
    assert.equal(first.headers['x-redacted'], undefined);
    assert.equal(seen.length, 1);
    assert.equal(seen[0].status, 201);
    assert.deepEqual(Object.keys(seen[0].headers).sort(), ['content-type', 'location']); // what a replay repeats
    assert.deepEqual(seen[0].body, first.body);
    const record = await idem.lookup(key, { scope: scopeOf('Bearer alice') });
    assert.deepEqual(record.headers, { 'x-redacted': 'yes' });
    assert.deepEqual(JSON.parse(record.body.toString()), { charge: 'redacted', tag });
    for (let i = 0; i < 2; i++) { // from the database, then from memory
      const again = await post('/charges', { tag }, { keys: [key], url: app.url });
      assert.equal(again.headers['idempotent-replayed'], 'true');
      assert.equal(again.headers['x-redacted'], 'yes');
      assert.deepEqual(again.json(), { charge: 'redacted', tag });
    }
    assert.equal(await charges(tag), 1);
  } finally {
    await app.close();
  }
});

test('redact: a stored 5xx is redacted; a redact that throws stores nothing: 500, writes rolled back, key free', async () => {
  const keeping = newPool({ options: '-c idempotency.store_server_errors=on' });
  const redacting = await listen(makeApp(keeping, { redact: redactCharge([]) }));
  const throwing = await listen(makeApp(pool, { redact: () => { throw new Error('no'); } }));
  try {
    const tag = unique('redact5xx');
    const key = unique('k');
    assert.equal((await post('/charges', { tag, status: 500 }, { keys: [key], url: redacting.url })).status, 500);
    const again = await post('/charges', { tag, status: 500 }, { keys: [key], url: redacting.url });
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.equal(again.json().charge, 'redacted');
    const failing = unique('k');
    for (let i = 0; i < 2; i++)
      assertProblem(await post('/charges', { tag }, { keys: [failing], url: throwing.url }), 500, 'idempotency_redact_failed');
    assert.equal(await charges(tag), 0);
    assert.equal(await idem.lookup(failing, { scope: scopeOf('Bearer alice') }), null);
  } finally {
    await redacting.close();
    await throwing.close();
    await keeping.end();
  }
});

test('a binary response is replayed byte for byte', async () => {
  const key = unique('k');
  const first = await post('/binary', '{}', { keys: [key] });
  const again = await post('/binary', '{}', { keys: [key] });
  assert.deepEqual(again.body, Buffer.from([0, 255, 13, 10, 128, 2]));
  assert.deepEqual(again.body, first.body);
  assert.equal(again.headers['idempotent-replayed'], 'true');
});

test('the bare key is the same key as its quoted form; an escaped key is stored unescaped', async () => {
  const tag = unique('bare');
  const key = unique('k');
  await post('/charges', { tag }, { keys: [key] });
  const quoted = await post('/charges', { tag }, { keys: [`"${key}"`] });
  assert.equal(quoted.headers['idempotent-replayed'], 'true');
  const escaped = await post('/charges', { tag }, { keys: [`"say \\"${key}\\" \\\\"`] });
  assert.equal(escaped.status, 201);
  assert.notEqual(await idem.lookup(`say "${key}" \\`, { scope: scopeOf('Bearer alice') }), null);
});

test('a missing key is 400 idempotency_key_missing; nothing runs', async () => {
  const tag = unique('nokey');
  assertProblem(await post('/charges', { tag }), 400, 'idempotency_key_missing');
  assert.equal(await charges(tag), 0);
});

test('a malformed key, a key sent twice or over 255 bytes is 400 idempotency_key_invalid', async () => {
  const tag = unique('badkey');
  const bad = [['"unterminated'], ['"abc";x=1'], ['?1'], [':YWJj:'], ['(a b)'], ['""'], ['"a\\qb"'],
    ['"a", "b"'], ['a b'], ['"a"', '"b"'], ['same', 'same'], [`"${'k'.repeat(256)}"`], ['']];
  for (const keys of bad) assertProblem(await post('/charges', { tag }, { keys }), 400, 'idempotency_key_invalid');
  assert.equal(await charges(tag), 0);
  const longest = unique('k').padEnd(255, 'x');
  assert.equal((await post('/charges', { tag }, { keys: [longest] })).status, 201);
});

test('the same key with another body, path or query is 422 idempotency_key_mismatch', async () => {
  const tag = unique('mismatch');
  const key = unique('k');
  await post('/charges', { tag }, { keys: [key] });
  assertProblem(await post('/charges', { tag, status: 200 }, { keys: [key] }), 422, 'idempotency_key_mismatch');
  assertProblem(await post('/charges?x=1', { tag }, { keys: [key] }), 422, 'idempotency_key_mismatch');
  assertProblem(await post('/echo', { tag }, { keys: [key] }), 422, 'idempotency_key_mismatch');
  assert.equal(await charges(tag), 1);
});

twoTransactionsOnly('a retry while the first runs is 409 idempotency_key_in_progress with Retry-After', async () => {
  const tag = unique('busy');
  const key = unique('k');
  const slow = post('/charges', { tag, delayMs: 700 }, { keys: [key] });
  await sleep(250);
  const busy = await post('/charges', { tag, delayMs: 700 }, { keys: [key] });
  assertProblem(busy, 409, 'idempotency_key_in_progress');
  assert.ok(Number(busy.headers['retry-after']) >= 1, busy.headers['retry-after']);
  assert.equal((await slow).status, 201);
  const after = await post('/charges', { tag, delayMs: 700 }, { keys: [key] });
  assert.equal(after.headers['idempotent-replayed'], 'true');
  assert.equal(await charges(tag), 1);
});

oneTransactionOnly('one transaction needs a positive wait: zero or negative is refused when mounted', () => {
  for (const wait of [0, -5, '0 seconds', '-2 seconds', '1 second ago'])
    assert.throws(() => idempotency(pool, { ...mode, wait }), /oneTransaction needs a positive wait/, String(wait));
  assert.doesNotThrow(() => idempotency(pool, { ...mode, wait: '500 milliseconds' }));
});

oneTransactionOnly('one transaction: a retry while the first runs waits for it and replays what committed', async () => {
  const tag = unique('waits');
  const key = unique('k');
  const slow = post('/charges', { tag, delayMs: 700 }, { keys: [key] });
  await sleep(250);
  const waited = await post('/charges', { tag, delayMs: 700 }, { keys: [key] });
  const first = await slow;
  assert.equal(first.status, 201);
  assert.equal(waited.status, 201, waited.body.toString());
  assert.equal(waited.headers['idempotent-replayed'], 'true');
  assert.deepEqual(waited.body, first.body);
  assert.equal(await charges(tag), 1);
});

oneTransactionOnly('one transaction: a retry that waits past its bound is 409 with Retry-After; nothing ran twice', async () => {
  const app = await listen(makeApp(pool, { wait: 200 }));
  try {
    const tag = unique('waits-bounded');
    const key = unique('k');
    const slow = post('/charges', { tag, delayMs: 1500 }, { keys: [key], url: app.url });
    await sleep(400);
    const busy = await post('/charges', { tag, delayMs: 1500 }, { keys: [key], url: app.url });
    assertProblem(busy, 409, 'idempotency_key_in_progress');
    assert.equal(busy.headers['retry-after'], '1');
    assert.equal((await slow).status, 201);
    assert.equal(await charges(tag), 1);
  } finally {
    await app.close();
  }
});

oneTransactionOnly('one transaction: a handler that fails leaves no record, so its retry runs at once', async () => {
  const tag = unique('one-fails');
  const key = unique('k');
  assert.equal((await post('/throws', { tag }, { keys: [key] })).status, 500);
  const { rows } = await pool.query('SELECT count(*)::int AS n FROM idempotency.keys WHERE key = $1', [key]);
  assert.equal(rows[0].n, 0, 'the claim rolled back with the handler\'s writes');
  assert.equal((await post('/charges', { tag }, { keys: [key] })).status, 201);
  assert.equal(await charges(tag), 1);
});

test('a 5xx answer goes out, its writes roll back and the key is released', async () => {
  const tag = unique('fail');
  const key = unique('k');
  const first = await post('/charges', { tag, status: 503 }, { keys: [key] });
  assert.equal(first.status, 503);
  assert.equal(first.json().tag, tag);
  assert.equal(await charges(tag), 0);
  assert.equal(await idem.lookup(key, { scope: scopeOf('Bearer alice') }), null);
  const retry = await post('/charges', { tag, status: 503 }, { keys: [key] });
  assert.equal(retry.headers['idempotent-replayed'], undefined);
  assert.notDeepEqual(retry.body, first.body);
});

test('a handler that throws: 500, its writes roll back, the key is released', async () => {
  const tag = unique('throws');
  const key = unique('k');
  assert.equal((await post('/throws', { tag }, { keys: [key] })).status, 500);
  assert.equal(await charges(tag), 0);
  assert.equal(await idem.lookup(key, { scope: scopeOf('Bearer alice') }), null);
});

test('with idempotency.store_server_errors on, a 5xx is stored and replayed; off, the retry runs again', async () => {
  const keeping = newPool({ options: '-c idempotency.store_server_errors=on' });
  const on = await listen(makeApp(keeping));
  try {
    const tag = unique('keep5xx');
    const key = unique('k');
    const first = await post('/charges', { tag, status: 500 }, { keys: [key], url: on.url });
    assert.equal(first.status, 500);
    assert.equal(first.headers['idempotent-replayed'], undefined);
    const again = await post('/charges', { tag, status: 500 }, { keys: [key], url: on.url });
    assert.equal(again.status, 500);
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.deepEqual(again.body, first.body);
    assert.equal(again.headers.location, first.headers.location);
    assert.equal(await charges(tag), 0); // its writes still rolled back
    const record = await idem.lookup(key, { scope: scopeOf('Bearer alice') });
    assert.equal(record.state, 'completed');
    assert.equal(record.statusCode, 500);
    const thrownKey = unique('k');
    const thrown = await post('/throws', { tag }, { keys: [thrownKey], url: on.url });
    assert.equal(thrown.status, 500);
    const thrownAgain = await post('/throws', { tag }, { keys: [thrownKey], url: on.url });
    assert.equal(thrownAgain.headers['idempotent-replayed'], 'true');
    assert.deepEqual(thrownAgain.body, thrown.body);
    assert.equal(await charges(tag), 0);
  } finally {
    await on.close();
    await keeping.end();
  }
  const tag = unique('drop5xx');
  const key = unique('k');
  const first = await post('/charges', { tag, status: 500 }, { keys: [key] });
  const retry = await post('/charges', { tag, status: 500 }, { keys: [key] });
  assert.equal(retry.status, 500);
  assert.equal(retry.headers['idempotent-replayed'], undefined);
  assert.notDeepEqual(retry.body, first.body); // it ran again: another charge id
  assert.equal(await idem.lookup(key, { scope: scopeOf('Bearer alice') }), null);
});

twoTransactionsOnly('an attempt that lost its lease to a retry: 409 idempotency_claim_lost, its writes rolled back', async () => {
  const app = await listen(makeApp(pool, { lease: '300 milliseconds' }));
  try {
    const tag = unique('lost');
    const key = unique('k');
    const lost = post('/charges', { tag, delayMs: 1200 }, { keys: [key], url: app.url });
    await sleep(600);
    const takeover = await post('/charges', { tag, delayMs: 1200 }, { keys: [key], url: app.url });
    assert.equal(takeover.status, 201);
    const first = await lost;
    assertProblem(first, 409, 'idempotency_claim_lost');
    assert.equal(first.headers['retry-after'], '1');
    assert.equal(first.headers.location, undefined);
    assert.equal(await charges(tag), 1);
    const replay = await post('/charges', { tag, delayMs: 1200 }, { keys: [key], url: app.url });
    assert.deepEqual(replay.body, takeover.body);
  } finally {
    await app.close();
  }
});

test('the database down: 503 idempotency_unavailable with Retry-After; nothing runs', async () => {
  const down = new Pool({ host: '127.0.0.1', port: 1, user: 'nobody', connectionTimeoutMillis: 2000 });
  const app = await listen(makeApp(down, { log: () => {} }));
  try {
    const res = await post('/charges', { tag: 'x' }, { keys: [unique('k')], url: app.url });
    assertProblem(res, 503, 'idempotency_unavailable');
    assert.equal(res.headers['retry-after'], '1');
  } finally {
    await app.close();
    await down.end();
  }
});

test('idempotency calls failing (no USAGE on the schema): 503, or unguarded with failOpen', async () => {
  const role = `idempotency_test_node_no_usage${suffix}`;
  await pool.query(`DO $$ BEGIN CREATE ROLE ${role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`);
  await pool.query(`GRANT SELECT, INSERT ON ${TABLE} TO ${role}`);
  const limited = newPool({ user: role });
  const closed = await listen(makeApp(limited, { log: () => {} }));
  const open = await listen(makeApp(limited, { failOpen: true, log: () => {} }));
  try {
    const tag = unique('failopen');
    const key = unique('k');
    assertProblem(await post('/charges', { tag }, { keys: [key], url: closed.url }), 503, 'idempotency_unavailable');
    assert.equal(await charges(tag), 0);
    assert.equal((await post('/charges', { tag }, { keys: [key], url: open.url })).status, 201);
    assert.equal((await post('/charges', { tag }, { keys: [key], url: open.url })).status, 201);
    assert.equal(await charges(tag), 2);
    assert.equal(await idem.lookup(key, { scope: scopeOf('Bearer alice') }), null);
  } finally {
    await closed.close();
    await open.close();
    await limited.end();
    await pool.query(`DROP OWNED BY ${role}; DROP ROLE ${role}`);
  }
});

twoTransactionsOnly('the lease is the database setting (ALTER ROLE ... SET idempotency.lease) unless the lease option is given', async () => {
  const role = `idempotency_test_node_lease${suffix}`;
  await pool.query(`DO $$ BEGIN CREATE ROLE ${role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`);
  await pool.query(`GRANT USAGE ON SCHEMA idempotency TO ${role}; ALTER ROLE ${role} SET idempotency.lease = '17s'`);
  const limited = newPool({ user: role });
  // A handler that holds its request in progress until the test has read the record's lease.
  let finish;
  const held = new Promise((resolve) => { finish = resolve; });
  const appWith = (options) => express().use(idempotency(limited, { ...mode, ...options }))
    .post('/held', async (req, res) => res.status(201).json(await held));
  const byDefault = await listen(appWith({}));
  const given = await listen(appWith({ lease: '42 seconds' }));
  // Waits until key is in progress; returns its lease in seconds.
  const leaseOf = async (key) => {
    for (;;) {
      const { rows } = await pool.query(`SELECT extract(epoch FROM lease)::int AS s FROM idempotency.keys
        WHERE key = $1 AND state = 'in_progress'`, [key]);
      if (rows.length > 0) return rows[0].s;
      await sleep(10);
    }
  };
  try {
    const keys = [unique('k'), unique('k')];
    const answers = [post('/held', {}, { keys: [keys[0]], url: byDefault.url }),
      post('/held', {}, { keys: [keys[1]], url: given.url })];
    assert.equal(await leaseOf(keys[0]), 17);
    assert.equal(await leaseOf(keys[1]), 42);
    finish({});
    for (const res of await Promise.all(answers)) assert.equal(res.status, 201);
  } finally {
    finish({});
    await byDefault.close();
    await given.close();
    await limited.end();
    await pool.query(`DROP OWNED BY ${role}; DROP ROLE ${role}`);
  }
});

test('the scope is the hash of the credential: callers never share a key, the credential is not stored', async () => {
  const tag = unique('scope');
  const key = unique('k');
  const alice = await post('/charges', { tag }, { keys: [key], auth: 'Bearer sk_alice' });
  const bob = await post('/charges', { tag }, { keys: [key], auth: 'Bearer sk_bob' });
  assert.equal(bob.headers['idempotent-replayed'], undefined);
  assert.notDeepEqual(alice.body, bob.body);
  const { rows } = await pool.query('SELECT scope FROM idempotency.keys WHERE key = $1 ORDER BY scope', [key]);
  assert.deepEqual(rows.map((r) => r.scope).sort(), [scopeOf('Bearer sk_alice'), scopeOf('Bearer sk_bob')].sort());
  const apiKey = await send(server.url, { path: '/charges', body: JSON.stringify({ tag }),
    headers: [['Content-Type', 'application/json'], ['X-API-Key', 'k1'], ['Idempotency-Key', key]] });
  assert.equal(apiKey.status, 201);
  const expected = require('node:crypto').createHash('sha256').update('x-api-key:k1').digest('hex');
  assert.notEqual(await idem.lookup(key, { scope: expected }), null);
});

test('other methods pass through; required: false runs a keyless request unguarded', async () => {
  const put = await send(server.url, { method: 'PUT', path: '/echo', body: '{}', headers: [['Content-Type', 'application/json']] });
  assert.deepEqual(put.json(), { unguarded: true });
  const get = await send(server.url, { method: 'GET', path: `/charges/count?tag=none` });
  assert.equal(get.status, 200);
  const app = await listen(makeApp(pool, { required: false }));
  try {
    const tag = unique('optional');
    assert.equal((await post('/charges', { tag }, { url: app.url })).status, 201);
    assert.equal((await post('/charges', { tag }, { url: app.url })).status, 201);
    assert.equal(await charges(tag), 2);
  } finally {
    await app.close();
  }
});

test('the body: JSON parsed into req.body, raw bytes in req.rawBody; bad JSON 400; over the limit 413', async () => {
  const echo = await post('/echo', '{"a": [1, 2]}', { keys: [unique('k')] });
  assert.deepEqual(echo.json(), { body: { a: [1, 2] }, raw: Buffer.from('{"a": [1, 2]}').toString('base64') });
  assert.equal((await post('/echo', '{"a": ', { keys: [unique('k')] })).status, 400);
  const app = await listen(makeApp(pool, { limit: 10 }));
  try {
    assert.equal((await post('/echo', '{"a": "more than ten bytes"}', { keys: [unique('k')], url: app.url })).status, 413);
  } finally {
    await app.close();
  }
});

test('problemTypes sets the type URI of a problem', async () => {
  const app = await listen(makeApp(pool, { problemTypes: { idempotency_key_missing: 'https://example.com/missing' } }));
  try {
    const res = await post('/charges', { tag: 'x' }, { url: app.url });
    assert.equal(res.json().type, 'https://example.com/missing');
  } finally {
    await app.close();
  }
});
};
