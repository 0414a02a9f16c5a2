'use strict';
// The Express middleware when the database's answer is lost
// (docs/http-contract.md, "When an answer is lost"): the app's pool goes
// through the fault proxy (examples/faultproxy, path in FAULTPROXY), which
// lets the server answer and then cuts the connection (the idempotent
// function too, at the end). Each request must
// run its handler's writes exactly once and get the handler's answer, and
// the process must survive every dropped connection. Each test runs in
// three set-ups: two transactions with pipelining (pg 8.23 or later: the
// claim with BEGIN, complete with COMMIT), two transactions one statement
// at a time (a client without pipelining, as older pg), one transaction.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const express = require('express');
const pg = require('pg');
const { idempotency, idempotent } = require('pg-idempotency');
const { newPool, unique, listen, send, scopeOf, sleep } = require('./helpers');

const AUTH = 'Bearer faults';
const TABLE = 'pg_idempotency_test_fault_charges';
const direct = newPool();
const runs = new Map(); // tag => how many times the handler ran
let proxy;

// The statements (a RegExp) before which a client closes its connection
// instead of sending it, once: the server never sees it (a COMMIT lost on
// its way), unlike the proxy's cuts, which come after the server's answer.
let breakBefore = null;

// A pg.Client that honours breakBefore.
class BreakingClient extends pg.Client {
  query(config, ...rest) {
    const text = typeof config === 'string' ? config : config?.text;
    if (breakBefore && typeof text === 'string' && breakBefore.test(text)) {
      breakBefore = null;
      this.connection.stream.destroy();
    }
    return super.query(config, ...rest);
  }
}

// A pg.Client without pipelining, as pg before 8.23 (the middleware then
// sends its statements one at a time).
class SequentialClient extends BreakingClient {
  constructor(config) {
    super(config);
    delete this.pipeline;
  }
}

const SETUPS = [
  { name: 'two transactions, pipelined', options: {} },
  { name: 'two transactions, one statement at a time', options: {}, Client: SequentialClient },
  // Running ahead of its claim, the handler runs for every request,
  // duplicates included; only the claim's winner commits (counted in charges).
  { name: 'one transaction, running ahead of the claim', options: { oneTransaction: true }, ahead: true },
  { name: 'one transaction, after the claim', options: { oneTransaction: true, runAhead: false } },
];

// Starts the fault proxy in front of DATABASE_URL's server.
function startProxy() {
  if (!process.env.FAULTPROXY) throw new Error('FAULTPROXY must name examples/faultproxy/faultproxy.js');
  const target = new URL(process.env.DATABASE_URL);
  const { startProxy: start } = require(path.join(path.dirname(process.env.FAULTPROXY), 'start.js'));
  return start(`${target.hostname}:${target.port || 5432}`);
}

// Returns a pg.Pool on the test database through the proxy (no 'error' listener of its own).
function proxiedPool(Client) {
  const url = new URL(process.env.DATABASE_URL);
  url.hostname = '127.0.0.1';
  url.port = String(proxy.port);
  return new pg.Pool({ connectionString: url.href, Client: Client ?? BreakingClient });
}

test.before(async () => {
  await direct.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`);
  proxy = await startProxy();
});
test.after(async () => {
  await direct.end();
  proxy.stop();
});

// Starts the app of a set-up on a pool through the proxy; resolves to { url, close() }.
async function startApp(setup) {
  const pool = proxiedPool(setup.Client);
  const app = express();
  app.use(idempotency(pool, { log: () => {}, cache: false, ...setup.options }));
  app.post('/charges', async (req, res) => {
    runs.set(req.body.tag, (runs.get(req.body.tag) ?? 0) + 1);
    const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
    res.status(201).json({ charge: Number(rows[0].id) });
  });
  const server = await listen(app);
  return { url: server.url, close: async () => { await server.close(); await pool.end(); } };
}

let server; // the app of the set-up under test

// Posts a charge tagged tag with Idempotency-Key key.
function charge(key, tag) {
  return send(server.url, {
    path: '/charges', body: JSON.stringify({ tag }),
    headers: [['Content-Type', 'application/json'], ['Authorization', AUTH], ['Idempotency-Key', key]],
  });
}

// Returns the ids of the charges tagged tag.
async function chargesOf(tag) {
  const { rows } = await direct.query(`SELECT id FROM ${TABLE} WHERE tag = $1 ORDER BY id`, [tag]);
  return rows.map((r) => Number(r.id));
}

// Returns the record of key (state, attempt), or null.
async function recordOf(key) {
  const { rows } = await direct.query('SELECT state, attempt FROM idempotency.lookup($1, $2)', [key, scopeOf(AUTH)]);
  return rows[0] ?? null;
}

// Asserts one charge for tag, named by res (201), a completed record and a replayed retry.
async function assertExactlyOnce(res, key, tag) {
  assert.equal(res.status, 201, res.body.toString());
  const ids = await chargesOf(tag);
  assert.equal(ids.length, 1, `charges of ${tag}: ${ids}`);
  assert.deepEqual(res.json(), { charge: ids[0] });
  assert.equal((await recordOf(key)).state, 'completed');
  const retry = await charge(key, tag);
  assert.equal(retry.status, 201);
  assert.equal(retry.headers['idempotent-replayed'], 'true');
  assert.deepEqual(retry.body, res.body);
  assert.deepEqual(await chargesOf(tag), ids);
}

// Waits (bounded) until no other backend's last statement names key.
async function untilNoBackendHas(key) {
  for (let i = 0; i < 100; i++) {
    const { rows } = await direct.query(`SELECT count(*)::int AS n FROM pg_stat_activity
      WHERE pid <> pg_backend_pid() AND strpos(query, $1) > 0`, [key]);
    if (rows[0].n === 0) return;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  assert.fail(`a backend still holds ${key}`);
}

for (const setup of SETUPS) {
  test.describe(setup.name, () => {
    test.before(async () => { server = await startApp(setup); });
    test.after(() => server.close());
    test.beforeEach(() => {
      breakBefore = null;
      return proxy.control('POST', '/reset');
    });

    // Asserts that the handler ran n times for key (running ahead, it also runs for duplicates).
    function assertRuns(key, n) {
      if (!setup.ahead) assert.equal(runs.get(key), n);
    }

    test("the claim's answer lost: asked again with the same token, the handler runs once", async () => {
      const key = unique('claim-lost');
      await proxy.control('POST', '/cut?match=idempotency%5C.claim&scope=transaction');
      const res = await charge(key, key);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      await assertExactlyOnce(res, key, key);
      assertRuns(key, 1);
    });

    test("the claim's answer lost at every try: 503 after the retries, the handler never ran", async () => {
      const key = unique('claim-lost-always');
      await proxy.control('POST', '/cut?match=idempotency%5C.claim&scope=statement&times=4');
      const res = await charge(key, key);
      assert.equal(res.status, 503, res.body.toString());
      assert.equal(res.json().code, 'idempotency_unavailable');
      assert.equal((await proxy.control('GET', '/stats')).cuts, 4, 'asked 1 + 3 times');
      assertRuns(key, undefined);
      assert.deepEqual(await chargesOf(key), []);
    });

    test("the COMMIT's answer lost after it committed: the handler's answer, not an error", async () => {
      const key = unique('commit-lost');
      await proxy.control('POST', '/cut?match=idempotency%5C.complete&scope=transaction');
      const res = await charge(key, key);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      await assertExactlyOnce(res, key, key);
      assertRuns(key, 1);
    });

    test("the connection lost after complete with its COMMIT: one charge, the handler's answer", async () => {
      const key = unique('complete-cut');
      // complete and COMMIT travel in one query: the cut after its answer
      // comes after the COMMIT, and the claim asked again says replay.
      await proxy.control('POST', '/cut?match=idempotency%5C.complete&scope=statement');
      const res = await charge(key, key);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      await assertExactlyOnce(res, key, key);
      assertRuns(key, 1);
    });

    test('the COMMIT lost on its way: nothing was kept, so the handler runs again', async () => {
      const key = unique('rolled-back');
      breakBefore = /idempotency\.complete/;
      const res = await charge(key, key);
      assert.equal(breakBefore, null, 'the connection was broken');
      await assertExactlyOnce(res, key, key);
      assertRuns(key, 2);
      if (!setup.options.oneTransaction)
        assert.equal((await recordOf(key)).attempt, 1, 'the same claim, not a takeover');
    });

    test('the connection lost after the claim, before the handler: it runs once', async () => {
      const key = unique('claim-cut');
      // Two transactions: the claim committed, asked again it is new with the
      // same fence. One transaction: the claim rolled back with the
      // connection, asked again it is new.
      await proxy.control('POST', '/cut?match=idempotency%5C.claim&scope=statement');
      const res = await charge(key, key);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      await assertExactlyOnce(res, key, key);
      assertRuns(key, 1);
    });

    test('the claim cut on the app\'s side only (half-open): never a 409 for its own claim, never two charges', async () => {
      const key = unique('half-open');
      // The server keeps the connection, and the transaction it was in.
      await proxy.control('POST', '/cut?match=idempotency%5C.claim&scope=statement&keep=server');
      try {
        let res = await charge(key, key);
        assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
        if (setup.options.oneTransaction) {
          // The claim never committed and holds the key until the server
          // learns its connection is gone: asked again, a 503, nothing kept.
          assert.equal(res.status, 503, res.body.toString());
          assert.equal(res.json().code, 'idempotency_unavailable');
          assert.deepEqual(await chargesOf(key), []);
          await proxy.control('POST', '/drop');
          await untilNoBackendHas(key); // rolled back
          res = await charge(key, key);
        }
        await assertExactlyOnce(res, key, key);
      } finally {
        await proxy.control('POST', '/drop'); // what the server kept open, also after a failure
      }
    });

    test('every connection dropped and the next one refused: the request still runs once', async () => {
      const key = unique('refused');
      await charge(unique('warm'), 'warm'); // the pool has a connection to lose
      await proxy.control('POST', '/drop');
      await proxy.control('POST', '/refuse?count=1');
      const res = await charge(key, key);
      assert.equal((await proxy.control('GET', '/stats')).refused, 1);
      await assertExactlyOnce(res, key, key);
    });

  });
}

test("redact: the COMMIT's answer lost after it committed: the handler's own answer goes out, not what was stored", async () => {
  await proxy.control('POST', '/reset');
  const pool = proxiedPool();
  const app = express();
  app.use(idempotency(pool, { log: () => {}, cache: false, redact: (stored) => ({ ...stored, body: '{"charge":"redacted"}' }) }));
  app.post('/charges', async (req, res) => {
    const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
    res.status(201).json({ charge: Number(rows[0].id) });
  });
  const redacting = await listen(app);
  try {
    const key = unique('redact-commit-lost');
    await proxy.control('POST', '/cut?match=idempotency%5C.complete&scope=transaction');
    const post = () => send(redacting.url, {
      path: '/charges', body: JSON.stringify({ tag: key }),
      headers: [['Content-Type', 'application/json'], ['Authorization', AUTH], ['Idempotency-Key', key]],
    });
    const res = await post();
    assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
    assert.equal(res.status, 201, res.body.toString());
    assert.equal(res.headers['idempotent-replayed'], undefined);
    assert.deepEqual(res.json(), { charge: (await chargesOf(key))[0] });
    assert.deepEqual((await post()).json(), { charge: 'redacted' });
  } finally {
    await redacting.close();
    await pool.end();
  }
});

test('an idle connection dropped does not end the process (no pool listener of its own)', async () => {
  const pool = proxiedPool();
  idempotency(pool, { log: () => {} });
  await pool.query('SELECT 1'); // one idle connection
  assert.equal(pool.idleCount, 1);
  await proxy.control('POST', '/drop');
  for (let i = 0; i < 200 && pool.totalCount > 0; i++) await sleep(25);
  assert.equal(pool.totalCount, 0, 'the pool saw its connection go');
  await pool.end();
});

// The idempotent function shares the middleware's flow: the same lost answers, resolved by its token.
for (const oneTransaction of [true, false]) {
  test.describe(`the idempotent function, ${oneTransaction ? 'one transaction' : 'two transactions'}`, () => {
    let pool;
    let call;
    test.before(() => {
      pool = proxiedPool();
      call = idempotent(pool, async (run, tag) => {
        runs.set(tag, (runs.get(tag) ?? 0) + 1);
        const { rows } = await run.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [tag]);
        return { charge: Number(rows[0].id) };
      }, { key: (tag) => tag, oneTransaction, log: () => {} });
    });
    test.after(() => pool.end());
    test.beforeEach(() => {
      breakBefore = null;
      return proxy.control('POST', '/reset');
    });

    // Asserts that tag was charged once, by result, and that a duplicate gets result back.
    async function assertOnce(tag, result) {
      assert.deepEqual(await chargesOf(tag), [result.charge]);
      assert.deepEqual(await call(tag), result);
      assert.deepEqual(await chargesOf(tag), [result.charge]);
    }

    test("the claim's answer lost: asked again with the same token, the function runs once", async () => {
      const tag = unique('fn-claim-lost');
      await proxy.control('POST', '/cut?match=idempotency%5C.claim&scope=transaction');
      const result = await call(tag);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      assert.equal(runs.get(tag), 1);
      await assertOnce(tag, result);
    });

    test("the COMMIT's answer lost after it committed: the function's result, not an error", async () => {
      const tag = unique('fn-commit-lost');
      await proxy.control('POST', '/cut?match=idempotency%5C.complete&scope=statement');
      const result = await call(tag);
      assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
      assert.equal(runs.get(tag), 1);
      await assertOnce(tag, result);
    });

    test('the COMMIT lost on its way: nothing was kept, so the function runs again', async () => {
      const tag = unique('fn-rolled-back');
      breakBefore = /idempotency\.complete/;
      const result = await call(tag);
      assert.equal(breakBefore, null, 'the connection was broken');
      assert.equal(runs.get(tag), 2);
      await assertOnce(tag, result);
    });
  });
}
