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
