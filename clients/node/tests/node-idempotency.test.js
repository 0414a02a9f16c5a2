'use strict';
// PostgresStorageAdapter under @node-idempotency/core (the library behind
// @node-idempotency/nestjs, /express and /fastify), from the npm registry,
// and under the Express and Fastify plugins when they are installed.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { once } = require('node:events');
const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = require('@node-idempotency/core');
const { PostgresStorageAdapter } = require('pg-idempotency/node-idempotency');
const { ClaimLostError } = require('pg-idempotency');
const { newPool, unique, sleep, listen, send } = require('./helpers');
const { TABLE, optional, createTable, expressApp, fastifyApp } = require('./plugin-apps');

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

// The Express and Fastify plugins with the adapter, as apps serve them. Not
// every npm registry serves the plugins: without them these tests are skipped
// (../README.md, Tests, says how to run them).

const PLUGINS = [
  { name: 'Express', plugin: optional('@node-idempotency/express'), start: startExpress },
  { name: 'Fastify', plugin: optional('@node-idempotency/fastify'), start: startFastify },
];
const LIBRARY_KEY = 'node-idempotency:POST:/charges:k1'; // the library's prefix:METHOD:path:key

// Serves the Express plugin's app on 127.0.0.1; resolves to { url, close() }.
async function startExpress(plugin, adapter) {
  return listen(await expressApp(plugin, adapter, pool));
}

// Serves the Fastify plugin's app on 127.0.0.1; resolves to { url, close() }.
async function startFastify(plugin, adapter) {
  const app = await fastifyApp(plugin, adapter, pool);
  await app.listen({ port: 0, host: '127.0.0.1' });
  return { url: `http://127.0.0.1:${app.server.address().port}`, close: () => app.close() };
}

// Posts body as JSON to /charges with Idempotency-Key key; delayMs: the handler sleeps first.
function postCharge(url, key, body, delayMs = 0) {
  return send(url, { path: '/charges', body: JSON.stringify(body),
    headers: [['Content-Type', 'application/json'], ['Idempotency-Key', key], ['X-Delay-Ms', String(delayMs)]] });
}

// Returns how many charges the plugin apps made for tag.
async function pluginCharges(tag) {
  const { rows } = await pool.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [tag]);
  return rows[0].n;
}

// Returns the records of scope: [key, state, status_code, completed_at].
async function records(scope) {
  const { rows } = await pool.query(
    'SELECT key, state::text, status_code, completed_at FROM idempotency.keys WHERE scope = $1 ORDER BY key', [scope]);
  return rows.map((r) => [r.key, r.state, r.status_code, r.completed_at?.getTime() ?? null]);
}

// Runs body(app, scope) against a fresh app of the plugin (leaseMs: the adapter's lease).
async function withPluginApp(start, plugin, leaseMs, body) {
  const scope = unique('plugin');
  const app = await start(plugin, new PostgresStorageAdapter({ pool, scope, leaseMs }));
  try {
    await body(app, scope);
  } finally {
    await app.close();
  }
}

test.before(() => createTable(pool));

for (const { name, plugin, start } of PLUGINS) {
  const skip = plugin ? false : `@node-idempotency/${name.toLowerCase()} is not installed`;

  test(`${name} plugin: the first request runs, retries replay it, replays write nothing`, { skip }, () =>
    withPluginApp(start, plugin, undefined, async (app, scope) => {
      const tag = unique('once');
      const first = await postCharge(app.url, 'k1', { tag });
      assert.equal(first.status, 201);
      assert.equal(first.headers['idempotent-replayed'], undefined);
      assert.equal(first.json().tag, tag);
      const again = await postCharge(app.url, 'k1', { tag });
      assert.equal(again.status, 201);
      assert.equal(again.headers['idempotent-replayed'], 'true');
      assert.deepEqual(again.json(), first.json());
      assert.match(again.headers['content-type'], /^application\/json/);
      const stored = await records(scope);
      assert.deepEqual(stored.map((r) => r.slice(0, 3)), [[LIBRARY_KEY, 'completed', 201]]);
      const third = await postCharge(app.url, 'k1', { tag });
      assert.deepEqual([third.headers['idempotent-replayed'], third.json()], ['true', first.json()]);
      assert.deepEqual(await records(scope), stored); // the Fastify plugin hands replays to onResponse too
      assert.equal(await pluginCharges(tag), 1);
    }));

  test(`${name} plugin: a duplicate while the first runs is refused 409, another body too; neither is stored`, { skip }, () =>
    withPluginApp(start, plugin, undefined, async (app) => {
      const tag = unique('busy');
      const slow = postCharge(app.url, 'k1', { tag }, 700);
      await sleep(250);
      const duplicate = await postCharge(app.url, 'k1', { tag });
      assert.equal(duplicate.status, 409);
      assert.equal(duplicate.json().code, 'REQUEST_IN_PROGRESS');
      assert.equal(duplicate.headers['retry-after'], '1');
      const otherBody = await postCharge(app.url, 'k1', { tag, amount: 2 });
      assert.equal(otherBody.status, 409); // in progress comes before the fingerprint
      assert.equal(otherBody.json().code, 'REQUEST_IN_PROGRESS');
      assert.equal(otherBody.headers['idempotent-replayed'], undefined); // the first 409 was not stored
      const first = await slow;
      assert.equal(first.status, 201);
      const after = await postCharge(app.url, 'k1', { tag });
      assert.equal(after.headers['idempotent-replayed'], 'true');
      assert.deepEqual(after.json(), first.json());
      assert.equal(await pluginCharges(tag), 1);
    }));

  test(`${name} plugin: another body under a completed key is refused 422 and not stored`, { skip }, () =>
    withPluginApp(start, plugin, undefined, async (app) => {
      const tag = unique('mismatch');
      const first = await postCharge(app.url, 'k1', { tag });
      const other = await postCharge(app.url, 'k1', { tag, amount: 2 });
      assert.equal(other.status, 422);
      assert.equal(other.json().code, 'IDEMPOTENCY_FINGERPRINT_MISSMATCH');
      assert.equal(other.headers['idempotent-replayed'], undefined);
      const again = await postCharge(app.url, 'k1', { tag });
      assert.equal(again.status, 201);
      assert.deepEqual(again.json(), first.json());
      assert.equal(await pluginCharges(tag), 1);
    }));

  test(`${name} plugin: a 5xx is stored and replayed (the library replays errors); its writes stay`, { skip }, () =>
    withPluginApp(start, plugin, undefined, async (app, scope) => {
      const tag = unique('fails');
      const first = await postCharge(app.url, 'k1', { tag, fail: true });
      assert.equal(first.status, 500);
      const again = await postCharge(app.url, 'k1', { tag, fail: true });
      assert.equal(again.status, 500);
      assert.equal(again.headers['idempotent-replayed'], 'true');
      assert.deepEqual(again.json(), first.json());
      assert.deepEqual((await records(scope)).map((r) => r.slice(0, 3)), [[LIBRARY_KEY, 'completed', 500]]);
      assert.equal(await pluginCharges(tag), 1); // ran once; no transaction rolled its insert back
    }));

  test(`${name} plugin, one instance: of an owner taken over after its lease and the retry, the first to finish is stored`, { skip }, () =>
    withPluginApp(start, plugin, 300, async (app) => {
      // The adapter holds one fence per key, so a set of the key is taken to be its owner's.
      for (const [key, retryDelayMs, kept] of [['k1', 0, 'retry'], ['k2', 700, 'owner']]) {
        const tag = unique('lost');
        const slow = postCharge(app.url, key, { tag }, 900);
        await sleep(500);
        const retry = await postCharge(app.url, key, { tag }, retryDelayMs);
        const owner = await slow;
        assert.deepEqual([owner.status, retry.status], [201, 201]); // both ran, neither is told
        assert.equal(retry.headers['idempotent-replayed'], undefined);
        assert.notDeepEqual(owner.json(), retry.json());
        const again = await postCharge(app.url, key, { tag });
        assert.equal(again.headers['idempotent-replayed'], 'true');
        assert.deepEqual(again.json(), (kept === 'retry' ? retry : owner).json(), `${key}: the ${kept}'s`);
        assert.equal(await pluginCharges(tag), 2);
      }
    }));
}

test('Fastify plugin, two instances: an owner taken over after its lease answers 500 (IK001); the record keeps the retry\'s', {
  skip: PLUGINS[1].plugin ? false : '@node-idempotency/fastify is not installed',
}, async () => {
  const scope = unique('plugin');
  const plugin = PLUGINS[1].plugin;
  const loser = await startFastify(plugin, new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  const winner = await startFastify(plugin, new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  try {
    const tag = unique('lost');
    const slow = postCharge(loser.url, 'k1', { tag }, 900);
    await sleep(500);
    const takeover = await postCharge(winner.url, 'k1', { tag });
    assert.equal(takeover.status, 201);
    assert.equal(takeover.headers['idempotent-replayed'], undefined);
    const lost = await slow;
    assert.equal(lost.status, 500);
    assert.equal(lost.json().code, 'IK001');
    const again = await postCharge(loser.url, 'k1', { tag });
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.deepEqual(again.json(), takeover.json()); // the loser's 500 was not stored either
    assert.equal(await pluginCharges(tag), 2); // both ran: the plugins give no transaction
  } finally {
    await loser.close();
    await winner.close();
  }
});

test('Express plugin, two instances: an owner taken over after its lease has answered already; its ClaimLostError is unhandled', {
  skip: PLUGINS[0].plugin ? false : '@node-idempotency/express is not installed',
}, async () => {
  const scope = unique('plugin');
  const child = spawn(process.execPath, [path.join(__dirname, 'plugin-apps.js'), scope, '300'],
    { cwd: __dirname, stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (chunk) => { stderr += chunk; });
  const exited = new Promise((resolve) => child.on('exit', (code) => resolve(code)));
  const winner = await startExpress(PLUGINS[0].plugin, new PostgresStorageAdapter({ pool, scope, leaseMs: 300 }));
  try {
    const [port] = await once(child.stdout, 'data');
    const tag = unique('lost');
    const slow = postCharge(`http://127.0.0.1:${Number(port)}`, 'k1', { tag }, 900);
    await sleep(500);
    const takeover = await postCharge(winner.url, 'k1', { tag });
    assert.equal(takeover.status, 201);
    const lost = await slow;
    assert.equal(lost.status, 201); // sent before onResponse ran
    assert.notDeepEqual(lost.json(), takeover.json());
    assert.equal(await exited, 1); // the unhandled rejection ended the loser's process
    assert.match(stderr, /ClaimLostError/);
    const again = await postCharge(winner.url, 'k1', { tag });
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.deepEqual(again.json(), takeover.json());
    assert.equal(await pluginCharges(tag), 2);
  } finally {
    child.kill();
    await winner.close();
  }
});
