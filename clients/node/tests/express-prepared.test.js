'use strict';
// The Express middleware with prepare (claim and complete as SQL prepared
// statements) in one transaction, as bench/peers runs it; and what happens
// when a connection loses its prepared statements.
const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { idempotency } = require('pg-idempotency');
const { Pool } = require('pg');
const { unique, listen, send } = require('./helpers');

require('./express-suite')({ oneTransaction: true, prepare: true });

// A statement already prepared on the connection (by another copy of the
// module) is kept. DISCARD ALL on a connection drops what was prepared on
// it: a request there finds its statement gone, prepares it again and runs.
for (const oneTransaction of [false, true]) {
  test(`prepare${oneTransaction ? ', one transaction' : ''}: statements discarded from a connection are prepared again`, async (t) => {
    const url = new URL(process.env.DATABASE_URL);
    const pool = new Pool({ connectionString: url.href, max: 1 }); // one connection: the one discarded
    t.after(() => pool.end());
    const app = express();
    app.use(idempotency(pool, { prepare: true, oneTransaction }));
    app.post('/ok', async (req, res) => {
      const { rows } = await req.db.query('SELECT count(*)::int AS n FROM pg_prepared_statements');
      res.status(201).json({ prepared: rows[0].n });
    });
    const server = await listen(app);
    t.after(() => server.close());
    const post = (key) => send(server.url, {
      path: '/ok', body: '{}', headers: [['Content-Type', 'application/json'], ['Idempotency-Key', `"${key}"`]],
    });

    await pool.query('PREPARE pg_idempotency_claim_1 (text, bytea, text, interval, interval, interval, uuid) AS ' +
      'SELECT outcome, fence, attempt, status_code, headers, body, retry_after FROM idempotency.claim(' +
      '$1, $2, scope => $3, lease => $4, retention => $5, wait => $6, token => $7)');
    const first = await post(unique('prep'));
    assert.equal(first.status, 201);
    assert.deepEqual(first.json(), { prepared: 2 }, 'claim and complete are prepared on the connection');
    await pool.query('DISCARD ALL');
    assert.equal((await pool.query('SELECT count(*)::int AS n FROM pg_prepared_statements')).rows[0].n, 0);
    const key = unique('prep');
    const again = await post(key);
    assert.equal(again.status, 201, 'the request ran');
    assert.deepEqual(again.json(), { prepared: 2 }, 'after preparing again');
    const replay = await post(key);
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.deepEqual(replay.json(), { prepared: 2 });
  });
}

// Running ahead, a claim whose statement was gone never ran: asked again,
// its own answer goes out (here 422 for another request's key), and a
// request a timeout answered meanwhile is not run again.
test('prepare, one transaction: after a discarded statement, the claim asked again answers for itself', async (t) => {
  const pool = new Pool({ connectionString: new URL(process.env.DATABASE_URL).href, max: 1 });
  t.after(() => pool.end());
  let runs = 0;
  const app = express();
  app.use(idempotency(pool, { prepare: true, oneTransaction: true }));
  app.post('/ok', (req, res) => res.status(201).json({ ok: true }));
  app.post('/times-out', (req, res) => {
    runs += 1;
    if (runs === 1) { // as connect-timeout answers: req.timedout, then its 503
      req.timedout = true;
      return res.status(503).json({ timedOut: true });
    }
    return res.status(201).json({ ok: true });
  });
  const server = await listen(app);
  t.after(() => server.close());
  const post = (path, key, body) => send(server.url, {
    path, body, headers: [['Content-Type', 'application/json'], ['Idempotency-Key', `"${key}"`]],
  });

  const key = unique('prep');
  assert.equal((await post('/ok', key, '{}')).status, 201);
  await pool.query('DEALLOCATE ALL');
  assert.equal((await post('/ok', key, '{"other":1}')).status, 422, 'the mismatch, not a 503');
  await pool.query('DEALLOCATE ALL');
  const timedOut = await post('/times-out', unique('prep'), '{}');
  assert.equal(timedOut.status, 503, 'the timeout\'s answer');
  assert.equal(runs, 1, 'the handler did not run again');
});
