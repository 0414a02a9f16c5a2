'use strict';
// OpenTelemetry spans, read back from the SDK's in-memory exporter: the
// middleware in both modes, the idempotent function and the client, against the real database.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const express = require('express');
const { trace, SpanKind, SpanStatusCode } = require('@opentelemetry/api');
const {
  BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor,
} = require('@opentelemetry/sdk-trace-base');
const {
  idempotency, IdempotencyClient, ClaimLostError, fingerprint, idempotent,
} = require('pg-idempotency');
const { newPool, unique, listen, send } = require('./helpers');

const pool = newPool();
const TABLE = 'pg_idempotency_test_traced';
const CREDENTIAL = 'Bearer telemetry-secret-credential';

// The global provider (what the package uses by default), and one passed in.
const globalSpans = new InMemorySpanExporter();
trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(globalSpans)] }));
const ownSpans = new InMemorySpanExporter();
const ownProvider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(ownSpans)] });

test.before(() => pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`));
test.after(() => pool.end());

// The first 16 hex digits of SHA-256 of the key, as the spans carry it.
function hashOf(key) {
  return crypto.createHash('sha256').update(key, 'utf8').digest('hex').slice(0, 16);
}

// The finished spans of exporter for key: [{ name, kind, attributes, status }], in the order they ended.
function spansOf(exporter, key) {
  return exporter.getFinishedSpans()
    .filter((s) => s.attributes['idempotency.key_hash'] === hashOf(key))
    .map((s) => ({ name: s.name, kind: s.kind, attributes: { ...s.attributes }, status: s.status, events: s.events }));
}

// Asserts that nothing in the spans (names, attributes, events, status) contains any of secrets.
function assertNothingOf(spans, secrets) {
  const text = JSON.stringify(spans);
  for (const secret of secrets) assert.ok(!text.includes(secret), `a span holds ${secret}`);
}

// Starts an app with the middleware (options); its handler inserts a row and answers 201, or 500 when asked.
function start(options) {
  const app = express();
  app.use(idempotency(pool, { log: () => {}, cache: false, ...options }));
  app.post('/charges', async (req, res) => {
    const { rows } = await req.db.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [req.body.tag]);
    if (req.body.fail) return res.status(500).json({ error: 'failed' });
    return res.status(201).json({ charge: Number(rows[0].id) });
  });
  return listen(app);
}

// Posts body with key.
function post(url, key, body) {
  return send(url, {
    path: '/charges', body: JSON.stringify(body),
    headers: [['Content-Type', 'application/json'], ['Authorization', CREDENTIAL], ['Idempotency-Key', key]],
  });
}

for (const oneTransaction of [false, true]) {
  const mode = `oneTransaction: ${oneTransaction}`;

  test(`a fresh request, its replay and a mismatch, in spans (${mode})`, async () => {
    const app = await start({ oneTransaction });
    try {
      const key = unique('traced-key');
      const tag = unique('traced-body');
      assert.equal((await post(app.url, key, { tag })).status, 201);
      assert.equal((await post(app.url, key, { tag })).status, 201); // replay
      assert.equal((await post(app.url, key, { tag: unique('other-body') })).status, 422);
      const spans = spansOf(globalSpans, key);
      assert.deepEqual(spans.map((s) => [s.name, s.attributes['idempotency.outcome']]), [
        ['idempotency.claim', 'new'], ['idempotency.complete', 'stored'],
        ['idempotency.claim', 'replay'], ['idempotency.claim', 'mismatch'],
      ]);
      for (const s of spans) {
        assert.equal(s.kind, SpanKind.INTERNAL);
        assert.equal(s.status.code, SpanStatusCode.UNSET);
      }
      assert.equal(spans[0].attributes['idempotency.attempt'], 1);
      assert.deepEqual(Object.keys(spans[0].attributes).sort(),
        ['idempotency.attempt', 'idempotency.key_hash', 'idempotency.outcome']);
      assert.deepEqual(Object.keys(spans[1].attributes).sort(), ['idempotency.key_hash', 'idempotency.outcome']);
      assertNothingOf(spans, [key, tag, CREDENTIAL, 'telemetry-secret']);
    } finally {
      await app.close();
    }
  });

  test(`a 5xx's complete answers released (${mode})`, async () => {
    const app = await start({ oneTransaction });
    try {
      const key = unique('traced-key');
      assert.equal((await post(app.url, key, { tag: 'x', fail: true })).status, 500);
      assert.deepEqual(spansOf(globalSpans, key).map((s) => [s.name, s.attributes['idempotency.outcome']]),
        [['idempotency.claim', 'new'], ['idempotency.complete', 'released']]);
    } finally {
      await app.close();
    }
  });

  test(`a replay from memory is a claim span marked cached (${mode})`, async () => {
    const app = await start({ oneTransaction, cache: true });
    try {
      const key = unique('traced-key');
      assert.equal((await post(app.url, key, { tag: 'x' })).status, 201);
      for (let i = 0; i < 50 && !spansOf(globalSpans, key).some((s) => s.attributes['idempotency.cached']); i++) {
        assert.equal((await post(app.url, key, { tag: 'x' })).status, 201);
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      const cached = spansOf(globalSpans, key).filter((s) => s.attributes['idempotency.cached']);
      assert.ok(cached.length > 0, 'no replay came from memory');
      assert.equal(cached[0].name, 'idempotency.claim');
      assert.equal(cached[0].attributes['idempotency.outcome'], 'replay');
    } finally {
      await app.close();
    }
  });

  test(`tracerProvider: the spans go to the provider given, not the global one (${mode})`, async () => {
    const app = await start({ oneTransaction, tracerProvider: ownProvider });
    try {
      const key = unique('traced-key');
      assert.equal((await post(app.url, key, { tag: 'x' })).status, 201);
      assert.deepEqual(spansOf(ownSpans, key).map((s) => s.name), ['idempotency.claim', 'idempotency.complete']);
      assert.deepEqual(spansOf(globalSpans, key), []);
    } finally {
      await app.close();
    }
  });
}

test('the client: release, and errors with their SQLSTATE and no message', async () => {
  const idem = new IdempotencyClient(pool, { scope: 'telemetry-secret-scope' });
  const key = unique('traced-key');
  const claim = await idem.claim(key, fingerprint('POST', '/charges', 'body'));
  await assert.rejects(idem.complete(key, String(BigInt(claim.fence) + 1n), 201, 'telemetry-secret-body'), ClaimLostError);
  assert.equal(await idem.release(key, claim.fence), true);
  assert.equal(await idem.release(key, claim.fence), false);
  const spans = spansOf(globalSpans, key);
  assert.deepEqual(spans.map((s) => [s.name, s.attributes['idempotency.outcome']]), [
    ['idempotency.claim', 'new'], ['idempotency.complete', undefined],
    ['idempotency.release', 'released'], ['idempotency.release', 'not_owned'],
  ]);
  assert.equal(spans[1].status.code, SpanStatusCode.ERROR);
  assert.equal(spans[1].status.message, undefined);
  assert.equal(spans[1].attributes['db.response.status_code'], 'IK001');
  assertNothingOf(spans, [key, 'telemetry-secret']);

  const tooLong = 'k'.repeat(256); // refused by the extension: 22023
  await assert.rejects(idem.claim(tooLong, fingerprint('POST', '/charges')), { code: '22023' });
  const [refused] = spansOf(globalSpans, tooLong);
  assert.equal(refused.name, 'idempotency.claim');
  assert.equal(refused.status.code, SpanStatusCode.ERROR);
  assert.equal(refused.attributes['db.response.status_code'], '22023');
  assert.equal(refused.attributes['idempotency.outcome'], undefined);
});

test('without a registered SDK the API\'s no-op tracer answers and the key is not even hashed', async () => {
  trace.disable(); // no global provider: the API's no-op one
  const key = unique('untraced-key');
  let hashed = false; // whether anything hashed the key
  const { createHash } = crypto;
  crypto.createHash = (...args) => {
    const hash = createHash(...args);
    const update = hash.update.bind(hash);
    hash.update = (data, ...rest) => {
      if (String(data) === key) hashed = true;
      return update(data, ...rest);
    };
    return hash;
  };
  try {
    const idem = new IdempotencyClient(pool);
    const claim = await idem.claim(key, Buffer.alloc(32, 1));
    assert.equal(await idem.complete(key, claim.fence, 201, 'ok'), 'stored');
    assert.equal(hashed, false);
    assert.deepEqual(spansOf(globalSpans, key), []);
  } finally {
    crypto.createHash = createHash;
    trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(globalSpans)] }));
  }
});

test('the idempotent function: a claim and a complete span per run, a replay a claim span; no key, no result', async () => {
  const key = unique('fn-secret-key');
  const call = idempotent(pool, async (run, amount) => ({ paid: `secret-result-${amount}` }),
    { key: () => key, tracerProvider: ownProvider });
  await call(1);
  await call(1);
  const spans = spansOf(ownSpans, key);
  assert.deepEqual(spans.map((s) => [s.name, s.attributes['idempotency.outcome']]), [
    ['idempotency.claim', 'new'], ['idempotency.complete', 'stored'], ['idempotency.claim', 'replay'],
  ]);
  assert.equal(spans[0].attributes['idempotency.attempt'], 1);
  for (const span of spans) assert.equal(span.kind, SpanKind.INTERNAL);
  assertNothingOf(spans, [key, 'secret-result']);
});
