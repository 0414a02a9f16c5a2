'use strict';
// A small typed client of the extension's SQL API (schema idempotency), for
// code that is not an Express app. Every call is one statement; the scope is
// an argument of every call, never session state, so pooled connections
// (and pgbouncer in transaction mode) carry nothing between requests.

const { fingerprint } = require('./fingerprint');
const {
  tracerOf, traced, describeClaim, describeComplete, describeRelease,
} = require('./telemetry');

const CLAIM = `SELECT outcome, fence, attempt, status_code, headers, body, recovery_point,
       recovery_state, retry_after, created_at
  FROM idempotency.claim($1, $2, scope => $3, lease => $4::interval,
                         retention => $5::interval, wait => $6::interval, token => $7::uuid)`;
const COMPLETE = 'SELECT idempotency.complete($1, $2, $3, $4, $5::jsonb, $6) AS result';
// The same, keeping a 5xx response for this call (idempotency.store_server_errors on
// until the end of its transaction).
const COMPLETE_KEEPING_5XX = `SELECT idempotency.complete($1, $2, $3, $4, $5::jsonb, $6) AS result
  FROM (SELECT pg_catalog.set_config('idempotency.store_server_errors', 'on', true)) AS setting`;
const RELEASE = 'SELECT idempotency.release($1, $2, $3) AS released';
const EXTEND = 'SELECT idempotency.extend($1, $2, $3::interval, $4) AS lease_expires_at';
const CHECKPOINT = 'SELECT idempotency.checkpoint($1, $2, $3, $4::jsonb, $5)';
const LOOKUP = `SELECT key, scope, fingerprint, state, attempt, lease, lease_expires_at, recovery_point,
       recovery_state, status_code, headers, body, created_at, completed_at, expires_at
  FROM idempotency.lookup($1, $2)`;

// SQL literals, for statements sent as text so that several can travel in
// one simple query (BEGIN with a claim, complete with COMMIT): a string as
// an escape string (E'...', whatever standard_conforming_strings says),
// bytes as hex, NULL for null. PostgreSQL text cannot hold NUL, so a string
// with one is refused here as it would be there (22021).
function literal(value, type = null) {
  let text;
  if (value === null || value === undefined)
    text = 'NULL';
  else if (Buffer.isBuffer(value) || value instanceof Uint8Array)
    text = `E'\\\\x${Buffer.from(value).toString('hex')}'`;
  else {
    const s = String(value);
    if (s.includes('\0')) throw Object.assign(new TypeError('a string with a NUL character cannot be sent'), { code: '22021' });
    text = `E'${s.replace(/\\/g, '\\\\').replace(/'/g, "''")}'`;
  }
  return type ? `${text}::${type}` : text;
}

// The columns of claim's answer that an HTTP layer uses: the others
// (recovery point and state, created_at) are for multi-step work, and a
// column not asked for is one less for the client to parse.
const HTTP_COLUMNS = 'outcome, fence, attempt, status_code, headers, body, retry_after';

// The same and the recovery point and state, for work that resumes.
const RESUMING_COLUMNS = `${HTTP_COLUMNS}, recovery_point, recovery_state`;

// Returns the text of a claim whose arguments are literals (options as for
// claim()), answering the HTTP layer's columns only, or o.columns.
function claimText(key, fp, o) {
  const args = `${literal(key)}, ${literal(bytes(fp), 'bytea')}, scope => ${literal(o.scope, 'text')}, ` +
    `lease => ${literal(interval(o.lease), 'interval')}, retention => ${literal(interval(o.retention), 'interval')}, ` +
    `wait => ${literal(interval(o.wait), 'interval')}, token => ${literal(o.token, 'uuid')}`;
  return `SELECT ${o.columns ?? HTTP_COLUMNS} FROM idempotency.claim(${args})`;
}

// Returns the text of a complete whose arguments are literals.
function completeText(key, fence, statusCode, body, headers, scope) {
  if (!/^-?[0-9]+$/.test(String(fence))) throw new TypeError(`not a fence: ${fence}`);
  if (!Number.isInteger(statusCode)) throw new TypeError(`not a status code: ${statusCode}`);
  return `SELECT idempotency.complete(${literal(key)}, ${fence}, ${statusCode}, ${literal(bytes(body), 'bytea')}, ` +
    `${literal(json(headers), 'jsonb')}, ${literal(scope, 'text')}) AS result`;
}

// The HTTP layer's claim and complete as SQL prepared statements: PREPAREd
// once per connection, then EXECUTEd with literal arguments, so that they
// still share a simple query with BEGIN or COMMIT while the server parses,
// analyses and plans them once per connection. A statement whose text
// changes gets a new name (the number), so that two versions never meet.
const PREPARED = {
  claim: 'pg_idempotency_claim_1', complete: 'pg_idempotency_complete_1',
};
const PREPARE = [
  `PREPARE ${PREPARED.claim} (text, bytea, text, interval, interval, interval, uuid) AS
  SELECT ${HTTP_COLUMNS} FROM idempotency.claim($1, $2, scope => $3, lease => $4, retention => $5, wait => $6, token => $7)`,
  `PREPARE ${PREPARED.complete} (text, bigint, int, bytea, jsonb, text) AS
  SELECT idempotency.complete($1, $2, $3, $4, $5, $6) AS result`,
];

// Returns the text of an EXECUTE of the prepared claim (options as for claim()).
function executeClaimText(key, fp, o) {
  return `EXECUTE ${PREPARED.claim} (${literal(key)}, ${literal(bytes(fp))}, ${literal(o.scope)}, ` +
    `${literal(interval(o.lease))}, ${literal(interval(o.retention))}, ${literal(interval(o.wait))}, ${literal(o.token)})`;
}

// Returns the text of an EXECUTE of the prepared complete.
function executeCompleteText(key, fence, statusCode, body, headers, scope) {
  if (!/^-?[0-9]+$/.test(String(fence))) throw new TypeError(`not a fence: ${fence}`);
  if (!Number.isInteger(statusCode)) throw new TypeError(`not a status code: ${statusCode}`);
  return `EXECUTE ${PREPARED.complete} (${literal(key)}, ${fence}, ${statusCode}, ${literal(bytes(body))}, ` +
    `${literal(json(headers))}, ${literal(scope)})`;
}

// Returns what claim() answers, from the row of a claim statement.
function claimFromRow(r) {
  return {
    outcome: r.outcome, fence: r.fence, attempt: r.attempt, statusCode: r.status_code,
    headers: r.headers, body: r.body, recoveryPoint: r.recovery_point,
    recoveryState: r.recovery_state, retryAfter: r.retry_after, createdAt: r.created_at,
  };
}

// The error complete, extend and checkpoint raise when the fence lost its claim (IK001).
class ClaimLostError extends Error {
  constructor(key, cause) {
    super(`the claim on idempotency key ${JSON.stringify(key)} was lost: ` +
      'its lease ended and a retry took it over, or it was released', { cause });
    this.name = 'ClaimLostError';
    this.code = 'IK001';
    this.key = key;
  }
}

// Returns an interval parameter: a PostgreSQL interval string, or milliseconds.
function interval(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === 'number') {
    if (!Number.isFinite(value)) throw new TypeError(`not a finite interval: ${value}`);
    return `${value} milliseconds`;
  }
  return String(value);
}

// Returns a bytea parameter: a Buffer, or null.
function bytes(body) {
  if (body === null || body === undefined) return null;
  return typeof body === 'string' ? Buffer.from(body, 'utf8') : Buffer.from(body);
}

// Returns a jsonb parameter: the JSON text, or null.
function json(value) {
  return value === null || value === undefined ? null : JSON.stringify(value);
}

// Runs a call that needs the claim's fence, turning IK001 into ClaimLostError.
async function fenced(key, run) {
  try {
    return await run();
  } catch (err) {
    if (err && err.code === 'IK001') throw new ClaimLostError(key, err);
    throw err;
  }
}

class IdempotencyClient {
  // db: a pg.Pool, pg.Client or pool client; defaults for scope, lease,
  // retention; tracerProvider: where the spans go (default the global one).
  constructor(db, { scope = null, lease = null, retention = null, tracerProvider = null } = {}) {
    if (!db || typeof db.query !== 'function') throw new TypeError('IdempotencyClient needs a pg Pool or Client');
    this.db = db;
    this.defaults = { scope, lease, retention };
    this.tracer = tracerOf(tracerProvider);
  }

  // Claims a key: { outcome: 'new' | 'replay' | 'in_progress' | 'mismatch', ... }.
  // options.token (a UUID) names this attempt: asked again with the same
  // token, a claim whose answer was lost answers new again (extension 1.2).
  async claim(key, fp, options = {}) {
    const o = { ...this.defaults, ...options };
    return traced(this.tracer, 'idempotency.claim', key, async () => {
      const { rows } = await (o.db ?? this.db).query(CLAIM, [key, bytes(fp), o.scope,
        interval(o.lease), interval(o.retention), interval(o.wait), o.token ?? null]);
      return claimFromRow(rows[0]);
    }, describeClaim);
  }

  // Stores the response and ends the claim: 'stored', or 'released' for a 5xx
  // (unless options.storeServerErrors).
  async complete(key, fence, statusCode, body = null, headers = null, options = {}) {
    const o = { ...this.defaults, ...options };
    return traced(this.tracer, 'idempotency.complete', key, () => fenced(key, async () => {
      const { rows } = await (o.db ?? this.db).query(o.storeServerErrors ? COMPLETE_KEEPING_5XX : COMPLETE,
        [key, fence, statusCode, bytes(body), json(headers), o.scope]);
      return rows[0].result;
    }), describeComplete);
  }

  // Frees the key so that the next retry runs again; false when the fence lost it.
  async release(key, fence, options = {}) {
    const o = { ...this.defaults, ...options };
    return traced(this.tracer, 'idempotency.release', key, async () => {
      const { rows } = await (o.db ?? this.db).query(RELEASE, [key, fence, o.scope]);
      return rows[0].released;
    }, describeRelease);
  }

  // Renews the lease (by options.lease, or the claim's own length); returns its new end.
  async extend(key, fence, options = {}) {
    const o = { scope: this.defaults.scope, ...options };
    return fenced(key, async () => {
      const { rows } = await (o.db ?? this.db).query(EXTEND,
        [key, fence, interval(o.lease), o.scope]);
      return rows[0].lease_expires_at;
    });
  }

  // Saves the progress of multi-step work and renews the lease.
  async checkpoint(key, fence, recoveryPoint, recoveryState = null, options = {}) {
    const o = { ...this.defaults, ...options };
    await fenced(key, () => (o.db ?? this.db).query(CHECKPOINT,
      [key, fence, recoveryPoint, json(recoveryState), o.scope]));
  }

  // Reads the record as claim would see it (no fence); null when there is none.
  async lookup(key, options = {}) {
    const o = { ...this.defaults, ...options };
    const { rows } = await (o.db ?? this.db).query(LOOKUP, [key, o.scope]);
    if (rows.length === 0) return null;
    const r = rows[0];
    return {
      key: r.key, scope: r.scope, fingerprint: r.fingerprint, state: r.state, attempt: r.attempt, lease: r.lease,
      leaseExpiresAt: r.lease_expires_at, recoveryPoint: r.recovery_point,
      recoveryState: r.recovery_state, statusCode: r.status_code, headers: r.headers,
      body: r.body, createdAt: r.created_at, completedAt: r.completed_at, expiresAt: r.expires_at,
    };
  }
}

IdempotencyClient.fingerprint = fingerprint;

module.exports = {
  IdempotencyClient, ClaimLostError, interval, claimText, completeText, claimFromRow,
  PREPARE, executeClaimText, executeCompleteText, RESUMING_COLUMNS,
};
