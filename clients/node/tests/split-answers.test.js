'use strict';
// The server sends an error on its own (it flushes an ErrorResponse at
// once) and its ReadyForQuery after: a client can read the error, and pg
// reject the statement, before the ReadyForQuery that gives the
// transaction's status has arrived. A proxy here passes every error on and
// holds what follows it back for a while, so that this is what always
// happens; a connection must still never go back to the pool inside a
// transaction (then the next request on it would fail: 25P02, a 503).

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('node:net');
const express = require('express');
const { Pool } = require('pg');
const { idempotency } = require('pg-idempotency');
const { newPool, unique, listen, send, sleep } = require('./helpers');

const HOLD_MS = 100; // how long what follows an error is held back
const TABLE = 'pg_idempotency_test_split_charges';
const ROLE = 'idempotency_test_node_split_no_usage';
const admin = newPool();

// Starts a proxy to the database of DATABASE_URL; resolves to { port, close() }.
function splittingProxy() {
  const target = new URL(process.env.DATABASE_URL);
  const sockets = new Set();
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(target.port || 5432), target.hostname);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on('error', () => {});
      s.on('close', () => { client.destroy(); upstream.destroy(); });
    }
    client.pipe(upstream);
    let pending = Buffer.alloc(0);
    let sending = Promise.resolve();
    upstream.on('data', (chunk) => {
      pending = Buffer.concat([pending, chunk]);
      let at = 0; // the end of the whole messages read
      let from = 0; // the start of what is not yet queued for the client
      while (pending.length - at >= 5) {
        const end = at + 1 + pending.readInt32BE(at + 1);
        if (end > pending.length) break;
        if (pending[at] === 0x45) { // 'E', an ErrorResponse: on at once, what follows held back
          const piece = pending.subarray(from, end);
          sending = sending.then(() => { client.write(piece); return sleep(HOLD_MS); });
          from = end;
        }
        at = end;
      }
      const rest = pending.subarray(from, at);
      if (rest.length > 0) sending = sending.then(() => { client.write(rest); });
      pending = Buffer.from(pending.subarray(at));
    });
  });
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => resolve({
      port: server.address().port,
      close: () => {
        for (const s of sockets) s.destroy();
        return new Promise((done) => server.close(done));
      },
    }));
  });
}

test.before(async () => {
  await admin.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`);
  await admin.query(`DO $$ BEGIN CREATE ROLE ${ROLE} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`);
  await admin.query(`GRANT SELECT, INSERT ON ${TABLE} TO ${ROLE}`);
});
test.after(async () => {
  await admin.query(`DROP OWNED BY ${ROLE}; DROP ROLE ${ROLE}`);
  await admin.end();
});

for (const oneTransaction of [false, true]) {
  test(`a claim that fails gives its connection back outside any transaction (oneTransaction: ${oneTransaction})`, async () => {
    const proxy = await splittingProxy();
    const url = new URL(process.env.DATABASE_URL);
    url.hostname = '127.0.0.1';
    url.port = String(proxy.port);
    url.username = ROLE; // no USAGE on the schema: every claim fails (42501)
    const pool = new Pool({ connectionString: url.href, max: 1 }); // every request on the same connection
    const app = express();
    app.use(idempotency(pool, { oneTransaction, failOpen: true, log: () => {} }));
    app.post('/charges', async (req, res) => {
      await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1)`, [req.body.tag]);
      res.status(201).json({ ok: true });
    });
    const server = await listen(app);
    try {
      const tag = unique('split');
      for (let i = 0; i < 3; i++) {
        const res = await send(server.url, {
          path: '/charges', body: JSON.stringify({ tag }),
          headers: [['Content-Type', 'application/json'], ['Idempotency-Key', unique('k')]],
        });
        assert.equal(res.status, 201, `request ${i + 1}: ${res.body}`);
      }
      const { rows } = await admin.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [tag]);
      assert.equal(rows[0].n, 3);
    } finally {
      await server.close();
      await pool.end();
      await proxy.close();
    }
  });
}
