'use strict';
// The middleware through pgbouncer in transaction mode with its default
// settings (Debian's pgbouncer, started here on 127.0.0.1): every statement
// may run on another server connection, so nothing may rely on session
// state or named prepared statements. Both modes, fresh keys, replays,
// concurrent duplicates. Skipped, saying why, without /usr/sbin/pgbouncer.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const net = require('node:net');
const { spawn } = require('node:child_process');
const express = require('express');
const { Pool } = require('pg');
const { idempotency } = require('pg-idempotency');
const { newPool, unique, sleep, listen, send } = require('./helpers');

const PGBOUNCER = process.env.PGBOUNCER ?? '/usr/sbin/pgbouncer';
const available = fs.existsSync(PGBOUNCER);
const TABLE = 'pg_idempotency_test_pooled';
const direct = newPool();
let bouncer;
let dir;
let port;

// Resolves to a free TCP port on 127.0.0.1.
function freePort() {
  return new Promise((resolve) => {
    const server = net.createServer().listen(0, '127.0.0.1', () => {
      const { port: free } = server.address();
      server.close(() => resolve(free));
    });
  });
}

// Starts pgbouncer (pool_mode = transaction, nothing else changed) in front of DATABASE_URL's server.
async function startBouncer() {
  const target = new URL(process.env.DATABASE_URL);
  const db = target.pathname.slice(1);
  const user = decodeURIComponent(target.username || 'postgres');
  port = await freePort();
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pg-idempotency-pgbouncer-'));
  fs.chmodSync(dir, 0o755);
  fs.writeFileSync(path.join(dir, 'users.txt'), `"${user}" ""\n`);
  fs.writeFileSync(path.join(dir, 'pgbouncer.ini'), `[databases]
${db} = host=${target.hostname} port=${target.port || 5432} dbname=${db}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = ${port}
unix_socket_dir =
auth_type = trust
auth_file = ${path.join(dir, 'users.txt')}
pool_mode = transaction
`);
  const args = [path.join(dir, 'pgbouncer.ini')];
  if (process.getuid?.() === 0) args.unshift('-u', 'nobody'); // it refuses to run as root
  bouncer = spawn(PGBOUNCER, args, { stdio: ['ignore', 'ignore', 'pipe'] });
  bouncer.stderr.resume();
  for (let i = 0; i < 100; i++) {
    const up = await new Promise((resolve) => {
      const s = net.connect(port, '127.0.0.1', () => { s.end(); resolve(true); }).on('error', () => resolve(false));
    });
    if (up) return;
    await sleep(50);
  }
  throw new Error('pgbouncer did not start');
}

test.before(async () => {
  if (!available) return;
  await direct.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`);
  await startBouncer();
});
test.after(async () => {
  bouncer?.kill('SIGTERM');
  if (dir) fs.rmSync(dir, { recursive: true, force: true });
  await direct.end();
});

// Posts a charge tagged tag with key.
function post(url, key, tag) {
  return send(url, {
    path: '/charges', body: JSON.stringify({ tag }),
    headers: [['Content-Type', 'application/json'], ['Authorization', 'Bearer pooled'], ['Idempotency-Key', key]],
  });
}

for (const oneTransaction of [false, true]) {
  test(`through pgbouncer in transaction mode (oneTransaction: ${oneTransaction})`,
    { skip: !available && `no pgbouncer at ${PGBOUNCER}` }, async () => {
      const url = new URL(process.env.DATABASE_URL);
      url.hostname = '127.0.0.1';
      url.port = String(port);
      const pool = new Pool({ connectionString: url.href, max: 4 });
      const app = express();
      app.use(idempotency(pool, { oneTransaction, cache: false, log: () => {} }));
      app.post('/charges', async (req, res) => {
        const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
        res.status(201).json({ charge: Number(rows[0].id) });
      });
      const server = await listen(app);
      try {
        const tag = unique('pooled');
        for (let i = 0; i < 5; i++) {
          const key = unique('k');
          const first = await post(server.url, key, tag);
          assert.equal(first.status, 201, first.body.toString());
          const again = await post(server.url, key, tag);
          assert.equal(again.headers['idempotent-replayed'], 'true');
          assert.deepEqual(again.body, first.body);
        }
        const key = unique('k');
        const answers = await Promise.all(Array.from({ length: 8 }, () => post(server.url, key, `${tag}-dup`)));
        assert.ok(answers.every((a) => [201, 409].includes(a.status)), answers.map((a) => a.status).join());
        const { rows } = await direct.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1 OR tag = $2`,
          [tag, `${tag}-dup`]);
        assert.equal(rows[0].n, 6, 'one charge per key');
      } finally {
        await server.close();
        await pool.end();
      }
    });
}
