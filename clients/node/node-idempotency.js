'use strict';
// PostgresStorageAdapter: a StorageAdapter for @node-idempotency/core (and so
// @node-idempotency/nestjs, /express, /fastify) on the idempotency extension.
//
// The library stores its own JSON values: {"status":"IN_PROGRESS",
// "fingerPrint":...} with setIfNotExists, then {"status":"COMPLETE",...}
// with set. They map onto claim and complete: setIfNotExists claims the key
// with a lease (a crashed request's key frees itself when the lease ends,
// instead of staying "in progress" for the whole TTL), set completes it with
// the fence of that claim (an owner whose lease ended and was taken over is
// refused: ClaimLostError, IK001), get looks the record up.

const crypto = require('node:crypto');
const { IdempotencyClient } = require('./lib/client');
const { storageKey } = require('./lib/storage-key');

const DEFAULT_LEASE_MS = 60 * 1000;
const HEX = /^(?:[0-9a-f]{2}){1,63}$/;

// Returns the extension's fingerprint of the library's fingerPrint: 0x00 when
// it has none, 0x01 + the bytes of a hex digest (so it reads back), else 0x02 + SHA-256.
function encodeFingerPrint(fingerPrint) {
  if (fingerPrint === undefined || fingerPrint === null) return Buffer.from([0]);
  const text = String(fingerPrint);
  if (HEX.test(text)) return Buffer.concat([Buffer.from([1]), Buffer.from(text, 'hex')]);
  return Buffer.concat([Buffer.from([2]), crypto.createHash('sha256').update(text).digest()]);
}

// Returns the library's fingerPrint from a stored fingerprint (undefined when absent or hashed).
function decodeFingerPrint(fp) {
  return fp && fp[0] === 1 ? fp.subarray(1).toString('hex') : undefined;
}

// Parses one of the library's values, checking that it has the status expected.
function parseValue(val, status) {
  let value;
  try {
    value = JSON.parse(val);
  } catch {
    throw new TypeError('PostgresStorageAdapter: a value must be the JSON of @node-idempotency/core');
  }
  if (value === null || value.status !== status)
    throw new TypeError(`PostgresStorageAdapter: expected a value with status ${status}`);
  return value;
}

// The codes of the library's own refusals (IdempotencyErrorCodes).
const REFUSALS = new Set(['REQUEST_IN_PROGRESS', 'IDEMPOTENCY_FINGERPRINT_MISSMATCH',
  'IDEMPOTENCY_KEY_LEN_EXEEDED', 'IDEMPOTENCY_KEY_MISSING']);

// True when a COMPLETE value holds one of the library's own refusals, not a
// handler's response (the Fastify plugin hands its 409 and 422 answers to onResponse too).
function isRefusal(value) {
  let error = value.response?.error;
  if (typeof error === 'string') {
    try {
      error = JSON.parse(error);
    } catch {
      return false;
    }
  }
  return REFUSALS.has(error?.code);
}

// Returns the HTTP status to record: the plugins' additional.statusCode when valid, else 200.
function statusOf(value) {
  const code = value.response?.additional?.statusCode;
  return Number.isInteger(code) && code >= 100 && code <= 599 ? code : 200;
}

class PostgresStorageAdapter {
  #client;
  #leaseMs;
  #fences = new Map(); // storage key => the fence of a claim this adapter holds

  // pool: a pg.Pool; leaseMs: how long an in-progress request holds its key
  // (default 60 s); scope: whose records these are (default ''); tracerProvider:
  // where the spans go (default OpenTelemetry's global one).
  constructor({ pool, leaseMs = DEFAULT_LEASE_MS, scope = '', tracerProvider = null } = {}) {
    if (!pool || typeof pool.query !== 'function')
      throw new TypeError('PostgresStorageAdapter needs { pool }: a pg.Pool');
    if (!(leaseMs > 0)) throw new TypeError('PostgresStorageAdapter: leaseMs must be positive');
    this.#client = new IdempotencyClient(pool, { scope, tracerProvider });
    this.#leaseMs = leaseMs;
  }

  // Claims the key for an IN_PROGRESS value; true when this request won it.
  async setIfNotExists(key, val, { ttl } = {}) {
    const value = parseValue(val, 'IN_PROGRESS');
    const k = storageKey(key);
    const retention = ttl > 0 ? ttl : null;
    const claim = await this.#client.claim(k, encodeFingerPrint(value.fingerPrint),
      { lease: retention ? Math.min(this.#leaseMs, retention) : this.#leaseMs, retention });
    if (claim.outcome !== 'new') return false;
    this.#fences.set(k, claim.fence);
    return true;
  }

  // Completes the claim this adapter holds with a COMPLETE value (errors included:
  // the library replays them); ClaimLostError when the claim was lost. A value
  // for a key this adapter holds no claim on (a replay sent again), or one of
  // the library's own refusals, is not written: the record is not this request's.
  async set(key, val) {
    const value = parseValue(val, 'COMPLETE');
    const k = storageKey(key);
    const fence = this.#fences.get(k);
    if (fence === undefined || isRefusal(value)) return;
    this.#fences.delete(k);
    await this.#client.complete(k, fence, statusOf(value), Buffer.from(val, 'utf8'), null,
      { storeServerErrors: true });
  }

  // Returns the stored value: the COMPLETE value as set, an IN_PROGRESS one, or undefined.
  async get(key) {
    const found = await this.#client.lookup(storageKey(key));
    if (found === null) return undefined;
    if (found.state === 'completed') return found.body.toString('utf8');
    const fingerPrint = decodeFingerPrint(found.fingerprint);
    return JSON.stringify({ status: 'IN_PROGRESS', ...(fingerPrint === undefined ? {} : { fingerPrint }) });
  }
}

module.exports = { PostgresStorageAdapter };
