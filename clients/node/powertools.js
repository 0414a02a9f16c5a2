'use strict';
// PostgresPersistenceLayer: a persistence layer for
// @aws-lambda-powertools/idempotency (makeIdempotent, makeHandlerIdempotent,
// the idempotent decorator) on the idempotency extension. Powertools' put /
// update / delete become claim / complete / release; its in-progress expiry
// (the Lambda's remaining time) becomes the claim's lease, so a timed-out
// call is taken over by its retry, and the timed-out call's save is fenced
// out (IK001).
//
// Powertools hands no token from _putRecord to _updateRecord or
// _deleteRecord: the fence of each claim this instance won is kept in the
// instance, by key, until its update or delete (see the README for what that
// assumes).

const crypto = require('node:crypto');
const { BasePersistenceLayer, IdempotencyRecord } =
  require('@aws-lambda-powertools/idempotency/persistence');
const {
  IdempotencyItemAlreadyExistsError, IdempotencyItemNotFoundError, IdempotencyUnknownError,
  IdempotencyRecordStatus,
} = require('@aws-lambda-powertools/idempotency');
const { IdempotencyClient, ClaimLostError } = require('./lib/client');
const { storageKey } = require('./lib/storage-key');

const DEFAULT_LEASE_MS = 60 * 1000;

// Returns the fingerprint of a Powertools payload hash ('' when validation is
// off): 'v' + the hash when it fits in 64 bytes (so it reads back), else 'h' + its SHA-256.
function encodePayloadHash(payloadHash = '') {
  const text = Buffer.from(`v${payloadHash}`, 'utf8');
  if (text.length <= 64) return text;
  return Buffer.concat([Buffer.from('h'), crypto.createHash('sha256').update(payloadHash).digest()]);
}

// Returns the payload hash a fingerprint was made from, or undefined when it was hashed.
function decodePayloadHash(fp) {
  return fp && fp[0] === 0x76 /* v */ ? fp.subarray(1).toString('utf8') : undefined;
}

// Returns the stored body of a function's result (JSON), null for undefined.
function encodeResult(result) {
  const text = JSON.stringify(result);
  return text === undefined ? null : Buffer.from(text, 'utf8');
}

// Returns the function's result from a stored body.
function decodeResult(body) {
  return body === null || body === undefined ? undefined : JSON.parse(body.toString('utf8'));
}

class PostgresPersistenceLayer extends BasePersistenceLayer {
  #client;
  #leaseMs;
  #fences = new Map(); // storage key => the fence of a claim this instance holds

  // pool: a pg.Pool; scope: whose records these are (default ''); leaseMs:
  // the lease when no Lambda context is registered (default 60 s);
  // tracerProvider: where the spans go (default OpenTelemetry's global one).
  constructor({ pool, scope = '', leaseMs = DEFAULT_LEASE_MS, tracerProvider = null } = {}) {
    super();
    if (!pool || typeof pool.query !== 'function')
      throw new TypeError('PostgresPersistenceLayer needs { pool }: a pg.Pool');
    if (!(leaseMs > 0)) throw new TypeError('PostgresPersistenceLayer: leaseMs must be positive');
    this.#client = new IdempotencyClient(pool, { scope, tracerProvider });
    this.#leaseMs = leaseMs;
  }

  // Claims the record: returns when this call won it, else throws
  // IdempotencyItemAlreadyExistsError with the record that is there.
  async _putRecord(record) {
    if (record.getStatus() !== IdempotencyRecordStatus.INPROGRESS)
      throw new IdempotencyUnknownError('Only INPROGRESS records can be inserted with _putRecord');
    const key = storageKey(record.idempotencyKey);
    const leaseMs = record.inProgressExpiryTimestamp === undefined ? this.#leaseMs
      : Math.max(1, record.inProgressExpiryTimestamp - Date.now());
    const retentionMs = Math.max(this.getExpiresAfterSeconds() * 1000, leaseMs);
    const claim = await this.#client.claim(key, encodePayloadHash(record.payloadHash),
      { lease: leaseMs, retention: retentionMs });
    if (claim.outcome === 'new') {
      this.#fences.set(key, claim.fence);
      return;
    }
    throw new IdempotencyItemAlreadyExistsError(
      `Failed to put record for already existing idempotency key: ${record.idempotencyKey}`,
      existingRecord(record, claim));
  }

  // Stores the function's result with the fence this instance holds; IK001 when it lost it.
  async _updateRecord(record) {
    const key = storageKey(record.idempotencyKey);
    const fence = this.#fences.get(key);
    if (fence === undefined) throw new ClaimLostError(key);
    this.#fences.delete(key);
    await this.#client.complete(key, fence, 200, encodeResult(record.responseData));
  }

  // Releases the record after the function threw, so that the next call runs it again.
  async _deleteRecord(record) {
    const key = storageKey(record.idempotencyKey);
    const fence = this.#fences.get(key);
    if (fence === undefined) return; // not held by this instance: nothing of ours to free
    this.#fences.delete(key);
    await this.#client.release(key, fence);
  }

  // Reads a record (without claiming it); IdempotencyItemNotFoundError when there is none.
  async _getRecord(idempotencyKey) {
    const found = await this.#client.lookup(storageKey(idempotencyKey));
    if (found === null) throw new IdempotencyItemNotFoundError('Item does not exist in persistence store');
    const completed = found.state === 'completed';
    return new IdempotencyRecord({
      idempotencyKey,
      status: completed ? IdempotencyRecordStatus.COMPLETED : IdempotencyRecordStatus.INPROGRESS,
      expiryTimestamp: Math.floor(found.expiresAt.getTime() / 1000),
      inProgressExpiryTimestamp: completed ? undefined : found.leaseExpiresAt.getTime(),
      responseData: decodeResult(found.body),
      payloadHash: decodePayloadHash(found.fingerprint),
    });
  }
}

// Returns the Powertools record for a claim that did not win.
function existingRecord(record, claim) {
  const { idempotencyKey, payloadHash } = record;
  switch (claim.outcome) {
    case 'replay':
      return new IdempotencyRecord({ idempotencyKey, payloadHash,
        status: IdempotencyRecordStatus.COMPLETED, responseData: decodeResult(claim.body) });
    case 'in_progress':
      return new IdempotencyRecord({ idempotencyKey, payloadHash,
        status: IdempotencyRecordStatus.INPROGRESS,
        inProgressExpiryTimestamp: Date.now() + claim.retryAfter * 1000 });
    default: // mismatch: another payload holds the key (payload validation then refuses it)
      return new IdempotencyRecord({ idempotencyKey, payloadHash: undefined,
        status: IdempotencyRecordStatus.INPROGRESS });
  }
}

module.exports = { PostgresPersistenceLayer };
