'use strict';
// The middleware among the middleware teams stack around it, in the orders
// they write (README, "Timeouts and other middleware"): timeouts inside and
// outside it, express.json() and its body limit, compression, an
// authentication middleware that gives the scope, a tracing middleware.
// The rule under test: a response the handler did not produce by finishing
// (a timeout's, an error's) never commits the handler's writes and is never
// stored. Each test runs in both modes.

const test = require('node:test');
const assert = require('node:assert/strict');
const zlib = require('node:zlib');
const express = require('express');
const timeout = require('connect-timeout');
const compression = require('compression');
const { idempotency, IdempotencyClient } = require('pg-idempotency');
const { newPool, unique, sleep, listen, send, scopeOf } = require('./helpers');

const pool = newPool();
const idem = new IdempotencyClient(pool);
const TABLE = 'pg_idempotency_test_composed';
const AUTH = 'Bearer composed';
const TIMED = [['X-Timeout', '1']]; // the header that puts a request under the timeout

test.before(() => pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`));
test.after(() => pool.end());

// The route: inserts a charge tagged body.tag, waits body.sleepMs, answers 201.
async function chargeRoute(req, res) {
  const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
  if (req.body.sleepMs) await sleep(req.body.sleepMs);
  if (req.timedout) return; // connect-timeout's advice: stop once timed out
  res.status(201).json({ charge: Number(rows[0].id), tag: req.body.tag });
}

// connect-timeout(ms) for the requests that ask for it (X-Timeout), so that
// a retry is never timed out however busy the machine is.
function timeoutIfAsked(middleware) {
  return (req, res, next) => (req.headers['x-timeout'] ? middleware(req, res, next) : next());
}

// Answers an error as JSON with its status (Express's own handler would send HTML).
function errorHandler(err, req, res, next) { // eslint-disable-line no-unused-vars
  if (res.headersSent) return;
  res.status(err.status ?? 500).json({ error: err.message });
}

// A timeout middleware of the kind teams write: 408 after ms, marking the request timed out.
function timeout408(ms) {
  return (req, res, next) => {
    const timer = setTimeout(() => {
      req.timedout = true;
      res.status(408).json({ error: 'request timeout' });
    }, ms);
    res.on('finish', () => clearTimeout(timer));
    res.on('close', () => clearTimeout(timer));
    next();
  };
}

// Posts body as JSON with key; options: auth (Authorization), headers.
function post(url, key, body, { auth = AUTH, headers = [] } = {}) {
  return send(url, {
    path: '/charges', body: JSON.stringify(body),
    headers: [['Content-Type', 'application/json'], ['Authorization', auth], ['Idempotency-Key', key], ...headers],
  });
}

// Returns how many charges carry tag.
async function charges(tag) {
  const { rows } = await pool.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE tag = $1`, [tag]);
  return rows[0].n;
}

// Starts app (made by build(mode)), runs fn(url), stops it.
async function withApp(app, fn) {
  const server = await listen(app);
  try {
    return await fn(server.url);
  } finally {
    await server.close();
  }
}

// Asserts that a timed-out request left nothing: no charge (also after the
// handler went on past the timeout), no record, and that its retry runs.
async function assertTimedOutLeftNothing(url, res, status, key, tag) {
  assert.equal(res.status, status, res.body.toString());
  await sleep(700); // the handler goes on after the timeout; what it does then must not land
  assert.equal(await charges(tag), 0, 'the timed-out handler\'s writes rolled back');
  assert.equal(await idem.lookup(key, { scope: scopeOf(AUTH) }), null, 'the timeout\'s answer was not stored');
  const retry = await post(url, key, { tag });
  assert.equal(retry.status, 201, retry.body.toString());
  assert.equal(retry.headers['idempotent-replayed'], undefined);
  assert.equal(await charges(tag), 1);
}

for (const mode of [{ name: 'two transactions', options: {} }, { name: 'one transaction', options: { oneTransaction: true } }]) {
  test.describe(mode.name, () => {
    const guard = (options = {}) => idempotency(pool, { log: () => {}, ...mode.options, ...options });

    test('connect-timeout inside (idempotency, timeout, route): 503, its writes rolled back, nothing stored', () => {
      const app = express();
      app.use(guard());
      app.use(timeoutIfAsked(timeout('200ms')));
      app.post('/charges', chargeRoute);
      app.use(errorHandler);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('timeout-inside');
        const res = await post(url, key, { tag, sleepMs: 500 }, { headers: TIMED });
        await assertTimedOutLeftNothing(url, res, 503, key, tag);
      });
    });

    test('connect-timeout outside (timeout, idempotency, route): 503, its writes rolled back, nothing stored', () => {
      const app = express();
      app.use(timeoutIfAsked(timeout('200ms')));
      app.use(guard());
      app.post('/charges', chargeRoute);
      app.use(errorHandler);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('timeout-outside');
        const res = await post(url, key, { tag, sleepMs: 500 }, { headers: TIMED });
        await assertTimedOutLeftNothing(url, res, 503, key, tag);
      });
    });

    test('a timeout that answers while the middleware waits for a connection: the handler never runs, nothing kept', () => {
      let delayed = 1; // the first connection comes after the timeout
      const slowPool = new Proxy(pool, {
        get(target, name) {
          if (name === 'connect') {
            return async () => {
              if (delayed-- > 0) await sleep(400);
              return target.connect();
            };
          }
          const value = Reflect.get(target, name, target);
          return typeof value === 'function' ? value.bind(target) : value;
        },
      });
      const app = express();
      app.use(timeoutIfAsked(timeout('100ms')));
      app.use(idempotency(slowPool, { log: () => {}, ...mode.options }));
      app.post('/charges', chargeRoute);
      app.use(errorHandler);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('timeout-waiting');
        const res = await post(url, key, { tag }, { headers: TIMED });
        await assertTimedOutLeftNothing(url, res, 503, key, tag);
      });
    });

    test('a timeout answering 408 (setting req.timedout), inside: its writes rolled back, the 408 not stored', () => {
      const app = express();
      app.use(guard());
      app.use(timeoutIfAsked(timeout408(200)));
      app.post('/charges', chargeRoute);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('timeout-408');
        const res = await post(url, key, { tag, sleepMs: 500 }, { headers: TIMED });
        await assertTimedOutLeftNothing(url, res, 408, key, tag);
      });
    });

    test('a handler that goes on after its response: its later queries fail, they never run elsewhere', () => {
      const app = express();
      let late;
      app.use(guard());
      app.post('/charges', async (req, res) => {
        res.status(202).json({ accepted: true });
        await sleep(100);
        late = req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1)`, [req.body.tag]).then(() => 'ran', (err) => err.message);
      });
      return withApp(app, async (url) => {
        const tag = unique('late');
        assert.equal((await post(url, unique('k'), { tag })).status, 202);
        await sleep(300);
        assert.match(await late, /transaction has ended/);
        assert.equal(await charges(tag), 0);
      });
    });

    test('express.json() before the middleware: 500 saying so, nothing runs; after it: skipped, the limit is the middleware\'s', () => {
      const before = express();
      before.use(express.json());
      before.use(guard());
      before.post('/charges', chargeRoute);
      before.use(errorHandler);
      const after = express();
      after.use(guard({ limit: 64 }));
      after.use(express.json({ limit: 10 })); // sees a request already read: it leaves req.body alone
      after.post('/charges', chargeRoute);
      after.use(errorHandler);
      return withApp(before, (beforeUrl) => withApp(after, async (afterUrl) => {
        const tag = unique('json-before');
        const res = await post(beforeUrl, unique('k'), { tag });
        assert.equal(res.status, 500);
        assert.match(res.json().error, /before any body parser/);
        assert.equal(await charges(tag), 0);
        const ok = await post(afterUrl, unique('k'), { tag: 'short' });
        assert.equal(ok.status, 201, ok.body.toString());
        const big = await post(afterUrl, unique('k'), { tag: 'x'.repeat(100) });
        assert.equal(big.status, 413);
      }));
    });

    test('compression outside: the stored response is the handler\'s bytes, each answer compressed', () => {
      const app = express();
      app.use(compression({ threshold: 0 }));
      app.use(guard());
      app.post('/charges', chargeRoute);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('gzip');
        const gzip = [['Accept-Encoding', 'gzip']];
        const first = await post(url, key, { tag }, { headers: gzip });
        const again = await post(url, key, { tag }, { headers: gzip });
        assert.equal(first.headers['content-encoding'], 'gzip');
        assert.equal(again.headers['content-encoding'], 'gzip');
        assert.equal(again.headers['idempotent-replayed'], 'true');
        const body = zlib.gunzipSync(first.body);
        assert.deepEqual(zlib.gunzipSync(again.body), body);
        assert.deepEqual((await idem.lookup(key, { scope: scopeOf(AUTH) })).body, body);
        const plain = await post(url, key, { tag });
        assert.equal(plain.headers['content-encoding'], undefined);
        assert.deepEqual(plain.body, body);
        assert.equal(await charges(tag), 1);
      });
    });

    // One transaction: a compression middleware inside this one resets the
    // connection (a defect not mended yet; CHANGELOG, "Known").
    test('compression inside: Content-Encoding is stored with the body it describes', {
      skip: mode.options.oneTransaction && 'compression inside the one-transaction mode resets the connection (known defect)',
    }, () => {
      const app = express();
      app.use(guard());
      app.use(compression({ threshold: 0 }));
      app.post('/charges', chargeRoute);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('gzip-inside');
        const gzip = [['Accept-Encoding', 'gzip']];
        const first = await post(url, key, { tag }, { headers: gzip });
        const again = await post(url, key, { tag }, { headers: gzip });
        assert.equal(first.headers['content-encoding'], 'gzip');
        assert.equal(again.headers['idempotent-replayed'], 'true');
        assert.equal(again.headers['content-encoding'], 'gzip');
        assert.deepEqual(zlib.gunzipSync(again.body), zlib.gunzipSync(first.body));
        assert.equal(await charges(tag), 1);
      });
    });

    test('scope from the authenticated principal: a retry with a refreshed token replays; the default scope runs it again', () => {
      // An authentication middleware: the token names the account (token
      // "acct_42.v1", refreshed to "acct_42.v2").
      const authenticate = (req, res, next) => {
        req.user = { account: String(req.headers.authorization).replace(/^Bearer (\w+)\..*$/, '$1') };
        next();
      };
      const principal = express();
      principal.use(authenticate);
      principal.use(guard({ scope: (req) => `account:${req.user.account}` }));
      principal.post('/charges', chargeRoute);
      const byCredential = express();
      byCredential.use(authenticate);
      byCredential.use(guard());
      byCredential.post('/charges', chargeRoute);
      return withApp(principal, (principalUrl) => withApp(byCredential, async (credentialUrl) => {
        const tag = unique('refresh');
        const key = unique('k');
        const first = await post(principalUrl, key, { tag }, { auth: 'Bearer acct_42.v1' });
        const refreshed = await post(principalUrl, key, { tag }, { auth: 'Bearer acct_42.v2' });
        assert.equal(refreshed.headers['idempotent-replayed'], 'true');
        assert.deepEqual(refreshed.body, first.body);
        assert.equal(await charges(tag), 1);
        const other = unique('k');
        await post(credentialUrl, other, { tag }, { auth: 'Bearer acct_42.v1' });
        const again = await post(credentialUrl, other, { tag }, { auth: 'Bearer acct_42.v2' });
        assert.equal(again.headers['idempotent-replayed'], undefined, 'the default scope: another credential, another scope');
        assert.equal(await charges(tag), 3);
      }));
    });

    test('a tracing middleware outside sees every answer as sent: new, replayed, refused', () => {
      const spans = [];
      const app = express();
      app.use((req, res, next) => { // what a tracing middleware records, when the response is finished
        res.on('finish', () => spans.push({ status: res.statusCode, replayed: res.getHeader('idempotent-replayed') ?? null }));
        next();
      });
      app.use(guard());
      app.post('/charges', chargeRoute);
      return withApp(app, async (url) => {
        const key = unique('k');
        const tag = unique('traced');
        await post(url, key, { tag });
        await post(url, key, { tag });
        await post(url, key, { tag: 'another body' });
        assert.deepEqual(spans, [
          { status: 201, replayed: null }, { status: 201, replayed: 'true' }, { status: 422, replayed: null },
        ]);
      });
    });
  });
}
