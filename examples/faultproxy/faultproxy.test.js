'use strict';
// Tests of the fault proxy against a real PostgreSQL with the extension
// (examples/faultproxy/test starts one): it passes the protocol through, and
// a cut answer was done by the server although its client got none.
// Needs FAULTPROXY_TARGET (HOST:PORT, trust authentication), PGDATABASE
// (a database where CREATE EXTENSION idempotency is done), PGUSER, PSQL.

const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('node:net');
const { execFileSync } = require('node:child_process');
const { startProxy: start } = require('./start');

const TARGET = process.env.FAULTPROXY_TARGET;
const DB = process.env.PGDATABASE;
const USER = process.env.PGUSER ?? 'postgres';
const startProxy = () => start(TARGET);

// Builds a typed frontend message.
function message(type, ...parts) {
  const body = Buffer.concat(parts.map((p) => (typeof p === 'string' ? Buffer.from(`${p}\0`) : p)));
  const head = Buffer.alloc(5);
  head.write(type, 0);
  head.writeInt32BE(body.length + 4, 1);
  return Buffer.concat([head, body]);
}

const int16 = (n) => { const b = Buffer.alloc(2); b.writeInt16BE(n); return b; };

// A minimal protocol client (trust authentication), enough to send Query
// and Parse/Bind/Execute/Sync and to read what comes back.
class Wire {
  // Connects to port and completes the startup; resolves to the client.
  static async open(port) {
    const w = new Wire(net.connect(port, '127.0.0.1'));
    const params = Buffer.from(`user\0${USER}\0database\0${DB}\0\0`);
    const startup = Buffer.alloc(8);
    startup.writeInt32BE(params.length + 8);
    startup.writeInt32BE(196608, 4);
    w.socket.write(Buffer.concat([startup, params]));
    await w.untilReady();
    return w;
  }

  constructor(socket) {
    this.socket = socket;
    this.buf = Buffer.alloc(0);
    this.messages = [];
    this.waiter = null;
    this.ended = null;
    socket.on('data', (chunk) => {
      this.buf = Buffer.concat([this.buf, chunk]);
      while (this.buf.length >= 5 && this.buf.length >= 1 + this.buf.readInt32BE(1)) {
        const len = 1 + this.buf.readInt32BE(1);
        this.messages.push(this.buf.subarray(0, len));
        this.buf = this.buf.subarray(len);
      }
      this.wake();
    });
    const end = (err) => { this.ended ??= err ?? new Error('connection closed'); this.wake(); };
    socket.on('error', end);
    socket.on('close', () => end());
  }

  wake() {
    const w = this.waiter;
    this.waiter = null;
    if (w) w();
  }

  // Resolves to the messages up to and including the next ReadyForQuery; rejects when the connection ends first.
  async untilReady() {
    const got = [];
    for (;;) {
      while (this.messages.length > 0) {
        const m = this.messages.shift();
        got.push(m);
        if (m[0] === 0x5a) return got;
      }
      if (this.ended) throw this.ended;
      await new Promise((resolve) => { this.waiter = resolve; });
    }
  }

  // Runs sql by the simple protocol; resolves to the first column of each row ('E' errors throw).
  async query(sql) {
    this.socket.write(message('Q', sql));
    return rows(await this.untilReady());
  }

  // Returns the extended-protocol messages that run statement name (parsed from sql unless null) with text params.
  static execute(name, sql, params = []) {
    const parts = [];
    if (sql !== null) parts.push(message('P', name, sql, int16(0)));
    const values = params.map((v) => {
      const b = Buffer.from(v);
      const len = Buffer.alloc(4);
      len.writeInt32BE(b.length);
      return Buffer.concat([len, b]);
    });
    parts.push(message('B', '', name, int16(0), int16(values.length), ...values, int16(0)));
    parts.push(message('E', '', Buffer.alloc(4)));
    parts.push(message('S'));
    return Buffer.concat(parts);
  }

  close() {
    this.socket.destroy();
  }
}

// Returns the first column of each DataRow; throws an ErrorResponse's message.
function rows(messages) {
  const out = [];
  for (const m of messages) {
    if (m[0] === 0x45) throw new Error(m.subarray(5).toString().split('\0').find((f) => f.startsWith('M')).slice(1));
    if (m[0] === 0x44) {
      const len = m.readInt32BE(7);
      out.push(len < 0 ? null : m.toString('utf8', 11, 11 + len));
    }
  }
  return out;
}

// Runs sql on the server directly (not through the proxy).
async function direct(sql) {
  const w = await Wire.open(Number(TARGET.split(':')[1]));
  try {
    return await w.query(sql);
  } finally {
    w.close();
  }
}

const RUN = Date.now().toString(36); // keys of this run
const claimSql = (key) => `SELECT outcome FROM idempotency.claim('${key}', '\\x01'::bytea)`;

let proxy;
test.before(async () => { proxy = await startProxy(); });
test.after(() => proxy.stop());
test.beforeEach(() => proxy.control('POST', '/reset'));

test('passes queries, extended ones and large answers through', async () => {
  const w = await Wire.open(proxy.port);
  assert.deepEqual(await w.query('SELECT 1'), ['1']);
  w.socket.write(Wire.execute('s1', 'SELECT $1::int + 1', ['41']));
  assert.deepEqual(rows(await w.untilReady()), ['42']);
  w.socket.write(Wire.execute('s1', null, ['1'])); // the named statement again: Bind only
  assert.deepEqual(rows(await w.untilReady()), ['2']);
  const [big] = await w.query("SELECT repeat('x', 3000000)"); // spans many TCP reads
  assert.equal(big.length, 3000000);
  await assert.rejects(w.query('SELECT 1/0'), /division by zero/);
  assert.deepEqual(await w.query('SELECT 2'), ['2']);
  w.close();
  const s = await proxy.control('GET', '/stats');
  assert.equal(s.connections, 1);
  assert.equal(s.cuts, 0);
});

test('psql goes through (its SSLRequest answered N)', () => {
  const out = execFileSync(process.env.PSQL, ['-X', '-At', '-c', 'SELECT 40 + 2',
    `postgresql://${USER}@127.0.0.1:${proxy.port}/${DB}?sslmode=prefer`]);
  assert.equal(out.toString().trim(), '42');
});

test('a cut claim is committed, yet its client got no answer', async () => {
  await proxy.control('POST', '/cut?match=idempotency%5C.claim');
  const w = await Wire.open(proxy.port);
  await assert.rejects(w.query(claimSql(`fp-cut-${RUN}`)), /connection closed/);
  assert.deepEqual(await direct(`SELECT state FROM idempotency.lookup('fp-cut-${RUN}')`), ['in_progress']);
  const s = await proxy.control('GET', '/stats');
  assert.equal(s.cuts, 1);
  assert.equal(s.matched, 1);
  // Armed once: the next claim goes through, and meets the first one's record.
  const again = await Wire.open(proxy.port);
  assert.deepEqual(await again.query(claimSql(`fp-cut-${RUN}`)), ['in_progress']);
  again.close();
});

test('a named statement is cut at its execution, not at its Parse or Describe', async () => {
  const w = await Wire.open(proxy.port);
  const sql = 'SELECT outcome FROM idempotency.claim($1, $2::bytea)';
  w.socket.write(Wire.execute('claim', sql, [`fp-bind1-${RUN}`, '\\x01']));
  assert.deepEqual(rows(await w.untilReady()), ['new']);
  await proxy.control('POST', '/cut?match=idempotency%5C.claim');
  // Parsed and described again (as pgx does before running it): nothing ran, nothing cut.
  w.socket.write(Buffer.concat([message('P', 'claim2', sql, int16(0)), message('D', 'Sclaim2'), message('S')]));
  await w.untilReady();
  w.socket.write(Wire.execute('claim', null, [`fp-bind2-${RUN}`, '\\x01'])); // Bind and Execute only
  await assert.rejects(w.untilReady(), /connection closed/);
  assert.deepEqual(await direct(`SELECT state FROM idempotency.lookup('fp-bind2-${RUN}')`), ['in_progress']);
  assert.equal((await proxy.control('GET', '/stats')).matched, 1);
});

test('pipelined: the answers before the cut one arrive', async () => {
  await proxy.control('POST', '/cut?match=fp_pipe_second');
  const w = await Wire.open(proxy.port);
  w.socket.write(Buffer.concat([Wire.execute('', 'SELECT 1 AS fp_pipe_first'),
    Wire.execute('', 'SELECT 2 AS fp_pipe_second')]));
  assert.deepEqual(rows(await w.untilReady()), ['1']);
  await assert.rejects(w.untilReady(), /connection closed/);
});

test('scope=transaction cuts the COMMIT, after the statement answered', async () => {
  await direct(`CREATE TABLE IF NOT EXISTS fp_rows_${RUN} (n int)`);
  await proxy.control('POST', `/cut?match=insert%20into%20fp_rows_${RUN}&scope=transaction`);
  const w = await Wire.open(proxy.port);
  await w.query('BEGIN');
  await w.query(`INSERT INTO fp_rows_${RUN} VALUES (7)`); // answered
  assert.deepEqual(await w.query(`SELECT count(*) FROM fp_rows_${RUN} WHERE n = 7`), ['1']);
  await assert.rejects(w.query('COMMIT'), /connection closed/);
  assert.deepEqual(await direct(`SELECT count(*) FROM fp_rows_${RUN} WHERE n = 7`), ['1']);
  assert.equal((await proxy.control('GET', '/stats')).cuts, 1);
});

test('keep=server cuts the client only: the server keeps its transaction until drop', async () => {
  const key = `fp-keep-${RUN}`;
  const backend = `SELECT state FROM pg_stat_activity WHERE query LIKE '%${key}%' AND pid <> pg_backend_pid()`;
  await proxy.control('POST', '/cut?match=idempotency%5C.claim&keep=server');
  const w = await Wire.open(proxy.port);
  await w.query('BEGIN');
  await assert.rejects(w.query(claimSql(key)), /connection closed/);
  assert.equal((await proxy.control('GET', '/stats')).kept, 1);
  // The server never heard of the cut: its transaction still holds the claim.
  assert.deepEqual(await direct(backend), ['idle in transaction']);
  assert.deepEqual(await direct(`SELECT count(*) FROM idempotency.lookup('${key}')`), ['0']);
  await proxy.control('POST', '/drop');
  for (let i = 0; (await direct(backend)).length > 0; i++) {
    assert.ok(i < 100, 'the server did not see the dropped connection end');
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  assert.equal((await proxy.control('GET', '/stats')).kept, 0);
  // Rolled back: the key is free.
  assert.deepEqual(await direct(claimSql(key)), ['new']);
});

test('times=N cuts N times, then passes', async () => {
  await proxy.control('POST', '/cut?match=fp_times&times=2');
  for (let i = 0; i < 2; i++) {
    const w = await Wire.open(proxy.port);
    await assert.rejects(w.query('SELECT 1 AS fp_times'), /connection closed/);
  }
  const w = await Wire.open(proxy.port);
  assert.deepEqual(await w.query('SELECT 1 AS fp_times'), ['1']);
  w.close();
  assert.equal((await proxy.control('GET', '/stats')).cuts, 2);
});

test('refuse count=N closes the next N connections; ms=T refuses connecting', async () => {
  await proxy.control('POST', '/refuse?count=1');
  await assert.rejects(Wire.open(proxy.port), /connection closed|ECONNRESET/);
  const w = await Wire.open(proxy.port);
  assert.deepEqual(await w.query('SELECT 1'), ['1']);
  await proxy.control('POST', '/refuse?ms=60000');
  await assert.rejects(Wire.open(proxy.port), /ECONNREFUSED/);
  assert.deepEqual(await w.query('SELECT 2'), ['2'], 'open connections go on');
  w.close();
  assert.equal((await proxy.control('GET', '/stats')).refused, 1);
});

test('drop closes every open connection', async () => {
  const p = await startProxy(); // its own: the one above stopped listening
  try {
    const a = await Wire.open(p.port);
    const b = await Wire.open(p.port);
    assert.equal((await p.control('POST', '/drop')).dropped, 2);
    await assert.rejects(a.query('SELECT 1'), /connection closed|EPIPE|ECONNRESET/);
    await assert.rejects(b.query('SELECT 1'), /connection closed|EPIPE|ECONNRESET/);
    const c = await Wire.open(p.port);
    assert.deepEqual(await c.query('SELECT 1'), ['1']);
    c.close();
  } finally {
    p.stop();
  }
});
