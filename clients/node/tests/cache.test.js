'use strict';
// Replays from memory (the middleware's cache option): a replay read from
// the database is kept, keyed by scope, key and fingerprint, until the
// record expires; a repeat is answered without the database.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { idempotency } = require('pg-idempotency');
const { newPool, unique, sleep, listen, send } = require('./helpers');

const pool = newPool();
const TABLE = 'pg_idempotency_test_cached';
let connects = 0; // connections the middleware took from the pool
const counted = new Proxy(pool, {
  get(target, name) {
    if (name === 'connect') return () => { connects += 1; return target.connect(); };
    const value = Reflect.get(target, name, target);
    return typeof value === 'function' ? value.bind(target) : value;
  },
});

test.before(() => pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`));
test.after(() => pool.end());

// Starts an app with the middleware (options) on the counted pool; resolves to { url, close() }.
function start(options) {
  const app = express();
  app.use(idempotency(counted, { log: () => {}, ...options }));
  app.post('/charges', async (req, res) => {
    const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
    if (req.body.delayMs) await sleep(req.body.delayMs);
    res.status(201).json({ charge: Number(rows[0].id) });
  });
  return listen(app);
}

// Posts the same request until one is answered without taking a
// connection (a replay is kept once the middleware looked it up, off the
// answer's path), at most 50 times; resolves to that answer.
async function untilFromMemory(url, key, body) {
  for (let i = 0; i < 50; i++) {
    const before = connects;
    const res = await post(url, key, body);
    if (connects === before) return res;
    await sleep(50);
  }
  throw new Error('no answer came from memory');
}

// Posts body with key, as Bearer alice.
function post(url, key, body) {
  return send(url, {
    path: '/charges', body: JSON.stringify(body),
    headers: [['Content-Type', 'application/json'], ['Authorization', 'Bearer alice'], ['Idempotency-Key', key]],
  });
}

for (const oneTransaction of [false, true]) {
  test(`a replay read from the database is answered from memory next time (oneTransaction: ${oneTransaction})`, async () => {
    const app = await start({ oneTransaction });
    try {
      const key = unique('k');
      const tag = unique('cached');
      const first = await post(app.url, key, { tag });
      await post(app.url, key, { tag }); // read from the database, kept (once looked up)
      const again = await untilFromMemory(app.url, key, { tag });
      const before = connects;
      assert.equal(again.status, 201);
      assert.equal(again.headers['idempotent-replayed'], 'true');
      assert.equal(again.headers['content-type'], first.headers['content-type']);
      assert.deepEqual(again.body, first.body);
      const other = await post(app.url, key, { tag: 'another body' }); // another fingerprint: the database says 422
      assert.equal(other.status, 422);
      assert.ok(connects > before);
    } finally {
      await app.close();
    }
  });
}

test('cache: false asks the database every time', async () => {
  const app = await start({ cache: false });
  try {
    const key = unique('k');
    const tag = unique('uncached');
    await post(app.url, key, { tag });
    for (let i = 0; i < 3; i++) {
      const before = connects;
      assert.equal((await post(app.url, key, { tag })).headers['idempotent-replayed'], 'true');
      assert.equal(connects, before + 1);
    }
  } finally {
    await app.close();
  }
});

test('a kept replay ends with its record: after the retention the key runs again', async () => {
  const app = await start({ lease: '500 milliseconds', retention: '1 second' });
  try {
    const key = unique('k');
    const tag = unique('expiring');
    await post(app.url, key, { tag });
    assert.equal((await post(app.url, key, { tag })).headers['idempotent-replayed'], 'true'); // kept now
    await sleep(1300);
    const later = await post(app.url, key, { tag });
    assert.equal(later.status, 201);
    assert.equal(later.headers['idempotent-replayed'], undefined, 'expired: it ran again');
  } finally {
    await app.close();
  }
});

test('a key in progress is never kept: its retries keep asking the database', async () => {
  const app = await start({});
  try {
    const key = unique('k');
    const tag = unique('busy');
    const slow = post(app.url, key, { tag, delayMs: 600 });
    await sleep(200);
    assert.equal((await post(app.url, key, { tag, delayMs: 600 })).status, 409);
    await slow;
    const after = await post(app.url, key, { tag, delayMs: 600 });
    assert.equal(after.headers['idempotent-replayed'], 'true');
  } finally {
    await app.close();
  }
});
