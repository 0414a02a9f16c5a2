'use strict';
// The idempotent function (idempotent(pool, fn, options)), in both modes,
// on a real database: one run per key, duplicates get the stored result,
// racing calls, errors released or stored, the lease renewed, checkpoints
// resumed after a killed process, arguments fingerprinted canonically.

const test = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const path = require('node:path');
const {
  idempotent, IdempotencyInProgressError, IdempotencyMismatchError, IdempotencyStoredError, ClaimLostError,
} = require('pg-idempotency');
const { newPool, unique, sleep } = require('./helpers');

const pool = newPool();
const TABLE = 'pg_idempotency_test_function_charges';

test.before(() => pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`));
test.after(() => pool.end());

// Returns how many rows carry tag.
async function rowsOf(tag) {
  return (await pool.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [tag])).rows[0].n;
}

// Returns a promise and its resolve function.
function latch() {
  let open;
  const promise = new Promise((resolve) => { open = resolve; });
  return { promise, open };
}

// Returns a wrapped function that writes a row tagged order.tag and
// answers { charge, amount }; runs counts its runs; before(run, order)
// runs first when given.
function charger(options = {}, before = null) {
  const counter = { runs: 0 };
  counter.call = idempotent(pool, async (run, order) => {
    counter.runs += 1;
    if (before) await before(run, order);
    const { rows } = await run.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [order.tag]);
    return { charge: Number(rows[0].id), amount: order.amount };
  }, { key: (order) => order.tag, ...options });
  return counter;
}

for (const [mode, oneTransaction] of [['one transaction', true], ['two transactions', false]]) {
  test(`${mode}: runs once; a duplicate gets the stored result without running; the writes commit with it`, async () => {
    const c = charger({ oneTransaction });
    const tag = unique('once');
    const first = await c.call({ tag, amount: 10 });
    const again = await c.call({ amount: 10, tag }); // the same arguments in another key order
    assert.deepEqual(again, first);
    assert.equal(c.runs, 1);
    assert.equal(await rowsOf(tag), 1);
    const { rows } = await pool.query("SELECT state, status_code FROM idempotency.keys WHERE key = $1", [tag]);
    assert.deepEqual(rows, [{ state: 'completed', status_code: 200 }]);
  });

  test(`${mode}: racing calls of one key run once and all get its result`, async () => {
    const c = charger({ oneTransaction, wait: '10 seconds' });
    const tag = unique('race');
    const results = await Promise.all(Array.from({ length: 8 }, () => c.call({ tag, amount: 3 })));
    assert.equal(c.runs, 1);
    for (const r of results) assert.deepEqual(r, results[0]);
    assert.equal(await rowsOf(tag), 1);
  });

  test(`${mode}: a duplicate while the first runs waits, then gets IdempotencyInProgressError`, async () => {
    const started = latch();
    const proceed = latch();
    const c = charger({ oneTransaction, wait: '200 milliseconds' }, async () => {
      started.open();
      await proceed.promise;
    });
    const tag = unique('busy');
    const first = c.call({ tag, amount: 1 });
    await started.promise;
    await assert.rejects(c.call({ tag, amount: 1 }), (err) => err instanceof IdempotencyInProgressError &&
      err.code === 'idempotency_key_in_progress' && err.retryAfter >= 1);
    proceed.open();
    const result = await first;
    assert.deepEqual(await c.call({ tag, amount: 1 }), result);
    assert.equal(c.runs, 1);
  });

  test(`${mode}: the same key with other arguments is IdempotencyMismatchError`, async () => {
    const c = charger({ oneTransaction });
    const tag = unique('mismatch');
    await c.call({ tag, amount: 1 });
    await assert.rejects(c.call({ tag, amount: 2 }), IdempotencyMismatchError);
    assert.equal(c.runs, 1);
  });

  test(`${mode}: an error rolls the writes back and releases the key: the next call runs again`, async () => {
    let fail = true;
    const c = charger({ oneTransaction }, async (run, order) => {
      await run.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1)`, [order.tag]);
      if (fail) throw new Error('provider unreachable');
    });
    const tag = unique('error');
    await assert.rejects(c.call({ tag, amount: 1 }), /provider unreachable/);
    assert.equal(await rowsOf(tag), 0);
    fail = false;
    await c.call({ tag, amount: 1 });
    assert.equal(c.runs, 2);
    assert.equal(await rowsOf(tag), 2);
  });

  test(`${mode}: a final error is stored: duplicates get IdempotencyStoredError without running; the writes roll back`, async () => {
    class Declined extends Error {}
    const c = charger({ oneTransaction, final: (err) => err instanceof Declined }, async (run, order) => {
      await run.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1)`, [order.tag]);
      throw Object.assign(new Declined('card declined'), { code: 'card_declined' });
    });
    const tag = unique('final');
    await assert.rejects(c.call({ tag, amount: 1 }), Declined);
    await assert.rejects(c.call({ tag, amount: 1 }), (err) => err instanceof IdempotencyStoredError &&
      err.message === 'card declined' && err.error.code === 'card_declined' && err.error.name === 'Error');
    assert.equal(c.runs, 1);
    assert.equal(await rowsOf(tag), 0);
    // Marked final on the error itself (the default rule).
    const d = charger({ oneTransaction }, () => { throw Object.assign(new Error('no such account'), { final: true }); });
    const other = unique('final');
    await assert.rejects(d.call({ tag: other }), /no such account/);
    await assert.rejects(d.call({ tag: other }), IdempotencyStoredError);
    assert.equal(d.runs, 1);
  });

  test(`${mode}: a killed process: the next call ${oneTransaction ? 'runs at once (all rolled back)' : 'takes over when the lease ends and resumes after the checkpoint'}`, async () => {
    const tag = unique('killed');
    const child = spawn(process.execPath, [path.join(__dirname, 'function-child.js'), oneTransaction ? 'one' : 'two', tag, TABLE],
      { stdio: ['ignore', 'pipe', 'inherit'] });
    const exited = new Promise((resolve) => child.on('exit', resolve));
    await new Promise((resolve, reject) => {
      child.stdout.on('data', (chunk) => { if (String(chunk).includes('running')) resolve(); });
      child.on('exit', (code) => reject(new Error(`the child exited (${code}) before it ran`)));
    });
    child.kill('SIGKILL');
    await exited;
    if (!oneTransaction) { // the claim committed: it is taken over once its lease (1 s) ends
      for (;;) {
        const { rows } = await pool.query(`SELECT lease_expires_at < clock_timestamp() AS ended
          FROM idempotency.keys WHERE key = $1`, [tag]);
        if (rows[0].ended) break;
        await sleep(50);
      }
    }
    let seen;
    const c = charger({ oneTransaction, lease: '1 second', wait: '10 seconds' }, (run) => {
      seen = { attempt: run.attempt, point: run.recoveryPoint, state: run.recoveryState };
    });
    const result = await c.call({ tag, amount: 5 });
    assert.deepEqual(seen, oneTransaction ? { attempt: 1, point: null, state: null }
      : { attempt: 2, point: 'charged', state: { provider: 'ch_1' } });
    assert.equal(await rowsOf(tag), 1); // the killed run's row rolled back
    assert.deepEqual(await c.call({ tag, amount: 5 }), result);
  });
}

test('two transactions: the lease is renewed while the function runs, so no duplicate takes it over', async () => {
  const tag = unique('extend');
  const checked = {};
  const c = charger({ oneTransaction: false, lease: 600 }, async () => {
    const first = (await pool.query('SELECT lease_expires_at FROM idempotency.keys WHERE key = $1', [tag])).rows[0];
    for (;;) { // until the first lease has ended by the database's clock
      const { rows } = await pool.query('SELECT clock_timestamp() > $1 AS ended', [first.lease_expires_at]);
      if (rows[0].ended) break;
      await sleep(50);
    }
    const now = (await pool.query(`SELECT state, lease_expires_at > clock_timestamp() AS live
      FROM idempotency.keys WHERE key = $1`, [tag])).rows[0];
    checked.record = now;
    const duplicate = charger({ oneTransaction: false, lease: 600, wait: 0 });
    checked.duplicate = await duplicate.call({ tag, amount: 7 }).catch((err) => err);
    checked.duplicateRuns = duplicate.runs;
  });
  await c.call({ tag, amount: 7 });
  assert.deepEqual(checked.record, { state: 'in_progress', live: true });
  assert.ok(checked.duplicate instanceof IdempotencyInProgressError, String(checked.duplicate));
  assert.equal(checked.duplicateRuns, 0);
  assert.equal(c.runs, 1);
});

test('two transactions: a function that outlived its lease and was taken over gets ClaimLostError; its writes roll back', async () => {
  const tag = unique('lost');
  const taken = latch();
  const c = charger({ oneTransaction: false, lease: 300, extendEvery: 60_000 }, async () => {
    await taken.promise;
  });
  const first = c.call({ tag, amount: 1 });
  for (;;) { // until the lease has ended
    const { rows } = await pool.query(`SELECT lease_expires_at < clock_timestamp() AS ended
      FROM idempotency.keys WHERE key = $1`, [tag]);
    if (rows[0]?.ended) break;
    await sleep(50);
  }
  const winner = charger({ oneTransaction: false });
  const won = await winner.call({ tag, amount: 1 });
  taken.open();
  await assert.rejects(first, ClaimLostError);
  assert.equal(await rowsOf(tag), 1);
  assert.deepEqual(await winner.call({ tag, amount: 1 }), won);
});

test('the round trips: one transaction, 2 statements besides the function\'s for a fresh key, 1 and a ROLLBACK for a duplicate', async () => {
  const sent = [];
  const counting = {
    connect: async () => {
      const db = await pool.connect();
      const query = db.query.bind(db);
      if (!db.counted) {
        db.counted = true;
        db.query = (...args) => {
          sent.push(typeof args[0] === 'string' ? args[0] : args[0].text);
          return query(...args);
        };
      }
      return db;
    },
    query: (...args) => pool.query(...args),
    on: (...args) => pool.on(...args),
    listenerCount: (...args) => pool.listenerCount(...args),
  };
  const call = idempotent(counting, async (run, n) => n * 2, { key: () => tag });
  const tag = unique('trips');
  sent.length = 0;
  assert.equal(await call(21), 42);
  assert.equal(sent.length, 2, sent.join('\n'));
  assert.match(sent[0], /^BEGIN; SELECT [^;]* FROM idempotency\.claim\([^;]*\)$/s);
  assert.match(sent[1], /^SELECT idempotency\.complete\([^;]*; COMMIT$/s);
  sent.length = 0;
  assert.equal(await call(21), 42);
  await sleep(0);
  assert.equal(sent.length <= 2 && sent[0].startsWith('BEGIN;'), true, sent.join('\n'));
});

test('arguments need a canonical form: bigint, Map, functions and cycles are refused before anything runs', async () => {
  const c = charger({ key: () => unique('canon') });
  const cycle = {};
  cycle.self = cycle;
  for (const bad of [{ n: 1n }, { m: new Map() }, { f: () => 1 }, cycle])
    await assert.rejects(c.call(bad), TypeError);
  assert.equal(c.runs, 0);
});
