'use strict';
// OpenTelemetry spans of the calls into the extension (idempotency.claim,
// idempotency.complete, idempotency.release), through @opentelemetry/api,
// an optional peer dependency: without it nothing is traced; with it and no
// SDK registered, the API's no-op tracer answers and nothing is computed
// for the attributes. Attributes never hold the key (a hash of it instead),
// the scope, a body or a header value.

const crypto = require('node:crypto');
const { name: PACKAGE, version: VERSION } = require('../package.json');

// The API, or null when the application did not install it.
const api = loadApi();

// Returns @opentelemetry/api, or null when it is not installed.
function loadApi() {
  try {
    return require('@opentelemetry/api');
  } catch (err) {
    if (err?.code === 'MODULE_NOT_FOUND' && /@opentelemetry\/api/.test(err.message)) return null;
    throw err;
  }
}

// Returns the tracer of this package: from provider when given, else from
// the global tracer provider (whatever the application registers, even
// later); null without the API.
function tracerOf(provider) {
  if (provider === null || provider === undefined) return api ? api.trace.getTracer(PACKAGE, VERSION) : null;
  if (typeof provider.getTracer !== 'function') throw new TypeError('tracerProvider must be an OpenTelemetry TracerProvider');
  if (!api) throw new TypeError('tracerProvider needs the package @opentelemetry/api installed');
  return provider.getTracer(PACKAGE, VERSION);
}

// Returns the first 16 hex digits of SHA-256 of the key's UTF-8 bytes.
function keyHash(key) {
  return crypto.createHash('sha256').update(String(key), 'utf8').digest('hex').slice(0, 16);
}

// Returns the SQLSTATE of a server error (or of the one it wraps), else undefined.
function sqlstateOf(err) {
  for (let e = err; e; e = e.cause)
    if (typeof e.severity === 'string' && typeof e.code === 'string') return e.code;
  return undefined;
}

// Runs call(), which returns a promise, inside a span of tracer named name,
// for key; describe(result) returns { outcome, attempt } for its
// attributes. A failure sets the span's status to error with the SQLSTATE
// (no message: it may quote the key) and is thrown again. Without a tracer:
// call()'s own promise (no other on the request's path), rejected when it throws.
function traced(tracer, name, key, call, describe) {
  if (tracer) return inSpan(tracer, name, key, call, describe);
  try {
    return call();
  } catch (err) {
    return Promise.reject(err);
  }
}

// Runs call() inside a new span of tracer (see traced).
async function inSpan(tracer, name, key, call, describe) {
  const span = tracer.startSpan(name, { kind: api.SpanKind.INTERNAL });
  const recording = span.isRecording();
  if (recording) span.setAttribute('idempotency.key_hash', keyHash(key));
  try {
    const result = await api.context.with(api.trace.setSpan(api.context.active(), span), call);
    if (recording) setOutcome(span, describe(result));
    return result;
  } catch (err) {
    span.setStatus({ code: api.SpanStatusCode.ERROR });
    const sqlstate = sqlstateOf(err);
    if (sqlstate !== undefined) span.setAttribute('db.response.status_code', sqlstate);
    throw err;
  } finally {
    span.end();
  }
}

// Records a claim answered without the database (a replay from memory).
function tracedReplayFromMemory(tracer, key) {
  if (!tracer) return;
  const span = tracer.startSpan('idempotency.claim', { kind: api.SpanKind.INTERNAL });
  if (span.isRecording()) {
    span.setAttribute('idempotency.key_hash', keyHash(key));
    setOutcome(span, { outcome: 'replay' });
    span.setAttribute('idempotency.cached', true);
  }
  span.end();
}

// Sets the outcome and attempt attributes (those that are known).
function setOutcome(span, { outcome, attempt } = {}) {
  if (typeof outcome === 'string') span.setAttribute('idempotency.outcome', outcome);
  if (Number.isInteger(attempt)) span.setAttribute('idempotency.attempt', attempt);
}

// What a claim's result says: its outcome and attempt.
function describeClaim(claim) {
  return { outcome: claim?.outcome, attempt: claim?.attempt };
}

// What complete's result says: stored or released.
function describeComplete(result) {
  return { outcome: result };
}

// What release's result says: released, or lost when the fence no longer owned the claim.
function describeRelease(released) {
  return { outcome: released ? 'released' : 'not_owned' };
}

module.exports = {
  tracerOf, traced, tracedReplayFromMemory, describeClaim, describeComplete, describeRelease, keyHash,
};
