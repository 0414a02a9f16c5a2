'use strict';
// The idempotent function: wraps an async function so that each unit of
// work (a key, and a scope) runs once. The function gets a transaction
// (run.db) whose writes commit with its stored result; a duplicate gets the
// stored result back without running, waits (`wait`) for a run in progress
// and then fails with IdempotencyInProgressError; an error releases the key
// unless it is final (then it is stored, and duplicates get it back as
// IdempotencyStoredError). The flow is the middleware's (flow.js): the
// same claim, complete, token and round trips.

const crypto = require('node:crypto');
const { ClaimLostError, RESUMING_COLUMNS } = require('./client');
const { Flow, transactionHandle } = require('./flow');

const DEFAULTS = {
  scope: null, // a string, or (...args) => string; null: the setting idempotency.scope ('' when unset)
  oneTransaction: true, // false: the claim commits first (for a function that calls out of the database)
  lease: null, // null: the setting idempotency.lease (60s); two transactions: renewed while the function runs
  retention: null, // null: the setting idempotency.retention (24h)
  wait: '2 seconds', // how long a duplicate waits for the run in progress
  extendEvery: null, // milliseconds between lease renewals (two transactions); null: a third of the lease
  final: (err) => err?.final === true, // which errors are stored (and come back to duplicates)
  serialize: (value) => (value === undefined ? null : JSON.stringify(value)), // the result as stored
  deserialize: (text) => (text === null ? undefined : JSON.parse(text)), // the stored result as returned
  retries: 3, // how many times a claim or COMMIT whose answer was lost is asked again
  retryDelay: 50, // milliseconds before the first ask again, doubled each time
  log: (message) => console.error(`pg-idempotency: ${message}`),
  tracerProvider: null,
};

// The status codes of a stored result and of a stored (final) error.
const RESULT = 200;
const FAILURE = 400;

// The key is in progress: another run holds it past the wait.
class IdempotencyInProgressError extends Error {
  constructor(key, retryAfter) {
    super(`idempotency key ${JSON.stringify(key)} is in progress; retry in ${retryAfter} s`);
    this.name = 'IdempotencyInProgressError';
    this.code = 'idempotency_key_in_progress';
    this.key = key;
    this.retryAfter = retryAfter;
  }
}

// The key was used with other arguments.
class IdempotencyMismatchError extends Error {
  constructor(key) {
    super(`idempotency key ${JSON.stringify(key)} was used with other arguments`);
    this.name = 'IdempotencyMismatchError';
    this.code = 'idempotency_key_mismatch';
    this.key = key;
  }
}

// A final error of the first run, given back to a duplicate.
class IdempotencyStoredError extends Error {
  constructor(key, stored) {
    super(stored.message ?? 'the first run failed');
    this.name = 'IdempotencyStoredError';
    this.code = 'idempotency_stored_error';
    this.key = key;
    this.error = stored; // { name, message, code } of the first run's error
  }
}

// Returns the canonical JSON of value (the rule of every client, shown by
// clients/testdata/function-fingerprints.json): JSON.stringify's, with
// object keys sorted by UTF-16 code units and no whitespace;
// refuses what JSON would silently change or drop (bigint, functions,
// symbols, Map, Set, cycles), so that two calls with equal arguments, and
// only those, have the same fingerprint.
function canonicalJson(value, seen = new Set()) {
  if (value !== null && typeof value === 'object' && typeof value.toJSON === 'function') value = value.toJSON();
  if (value === null || typeof value === 'boolean' || typeof value === 'string') return JSON.stringify(value);
  if (typeof value === 'number') return JSON.stringify(value); // NaN and Infinity are null, as in JSON
  if (typeof value !== 'object' || value instanceof Map || value instanceof Set)
    throw new TypeError(`pg-idempotency: an argument of type ${value?.constructor?.name ?? typeof value} has no canonical form`);
  if (seen.has(value)) throw new TypeError('pg-idempotency: an argument refers to itself');
  seen.add(value);
  const text = Array.isArray(value)
    ? `[${value.map((v) => (v === undefined ? 'null' : canonicalJson(v, seen))).join(',')}]`
    : `{${Object.keys(value).sort().filter((k) => value[k] !== undefined)
      .map((k) => `${JSON.stringify(k)}:${canonicalJson(value[k], seen)}`).join(',')}}`;
  seen.delete(value);
  return text;
}

// Returns the fingerprint of a call's arguments: SHA-256 of their canonical JSON.
function argumentsFingerprint(args) {
  return crypto.createHash('sha256').update(`pg-idempotency function\n${canonicalJson(args)}`).digest();
}

// Returns what is stored of a final error: its name, message and code.
function storedError(err) {
  return { name: err?.name ?? 'Error', message: String(err?.message ?? err), code: err?.code ?? null };
}

// Wraps fn(run, ...args) so that each unit of work runs once; options.key(...args) names it.
function idempotent(pool, fn, options = {}) {
  if (!pool || typeof pool.connect !== 'function') throw new TypeError('idempotent() needs a pg.Pool');
  if (typeof fn !== 'function') throw new TypeError('idempotent() needs the function to run');
  if (typeof options.key !== 'function') throw new TypeError('idempotent() needs options.key: (...args) => the key');
  const opts = { ...DEFAULTS, ...options };
  const flow = new Flow(pool, { ...opts, prepare: false, claimColumns: RESUMING_COLUMNS });
  const scopeOf = typeof opts.scope === 'function' ? opts.scope : () => opts.scope;
  let leaseMs = null; // two transactions: the lease in effect, read once

  return async function idempotentCall(...args) {
    const key = opts.key(...args);
    if (typeof key !== 'string' || key === '') throw new TypeError('idempotent(): options.key must return a non-empty string');
    const c = Flow.work(key, scopeOf(...args), argumentsFingerprint(args));
    let got = await flow.claimRecovering(c);
    for (;;) {
      if (got.claim.outcome !== 'new') {
        Promise.resolve(flow.giveBack(got)).catch(() => {}); // its empty transaction ends after
        return answer(c, got.claim);
      }
      c.fence = got.claim.fence;
      const ran = await runOnce(c, got, args);
      if (!ran.lost) return ran.value;
      const resolved = await resolveLostCommit(c, ran);
      if (!resolved.again) return resolved.value;
      got = resolved.again;
    }
  };

  // Returns the stored result of a claim that did not win, or throws what it says.
  function answer(c, claim) {
    switch (claim.outcome) {
      case 'replay':
        return storedResult(c, claim);
      case 'in_progress':
        throw new IdempotencyInProgressError(c.key, claim.retryAfter);
      case 'mismatch':
        throw new IdempotencyMismatchError(c.key);
      default:
        throw new Error(`unexpected claim outcome ${claim.outcome}`);
    }
  }

  // Returns the result a replay carries, or throws the final error it stored.
  function storedResult(c, claim) {
    const text = claim.body === null ? null : claim.body.toString('utf8');
    if (claim.statusCode === FAILURE) throw new IdempotencyStoredError(c.key, JSON.parse(text));
    return opts.deserialize(text);
  }

  // Runs fn once in the claim's transaction and ends it: complete and
  // COMMIT; on an error, ROLLBACK and release (or store a final error).
  // Resolves to { value }, or { lost, value, body } when the COMMIT's answer was lost.
  async function runOnce(c, { db, claim }, args) {
    const handle = transactionHandle(db);
    const lease = opts.oneTransaction ? null : keepLeased(c);
    let value;
    let body;
    try {
      value = await fn(runContext(c, claim, handle.db), ...args);
      body = opts.serialize(value);
    } catch (err) {
      handle.open = false;
      lease?.stop();
      await fail(c, db, err);
      throw err;
    }
    handle.open = false;
    lease?.stop();
    let lost;
    try {
      lost = await flow.commitWork(db, c, RESULT, body, null);
    } catch (err) {
      throw err.code === 'IK001' ? new ClaimLostError(c.key, err) : err;
    }
    return lost ? { lost, value, body } : { value };
  }

  // The COMMIT's answer was lost: claims with the same token to learn what
  // happened (flow.reclaim). Resolves to { value } when it committed (the
  // replay), or to { again: the new claim } when it rolled back and fn runs again.
  async function resolveLostCommit(c, ran) {
    let got;
    try {
      got = await flow.reclaim(c);
    } catch (err) {
      throw new Error('pg-idempotency: the COMMIT\'s answer was lost and the database cannot tell ' +
        `whether it took effect; call again with the same arguments (${err.message})`, { cause: ran.lost });
    }
    if (got.db) return { again: got };
    const { claim } = got;
    if (claim.outcome === 'new')
      throw new Error('pg-idempotency: the connection was lost at every COMMIT; nothing was kept', { cause: ran.lost });
    if (claim.outcome === 'in_progress') throw new ClaimLostError(c.key, ran.lost);
    const stored = claim.body === null ? null : claim.body.toString('utf8');
    if (claim.outcome === 'replay' && claim.statusCode === RESULT && stored === ran.body) return { value: ran.value };
    return { value: answer(c, claim) };
  }

  // What fn gets as its first argument.
  function runContext(c, claim, db) {
    return {
      db, key: c.key, scope: c.scope, attempt: claim.attempt,
      recoveryPoint: claim.recoveryPoint, recoveryState: claim.recoveryState,
      // Records a recovery point (two transactions: committed at once, and
      // the lease renewed); a takeover's run gets it back.
      checkpoint: (point, state = null) => flow.client.checkpoint(c.key, c.fence, point, state,
        { scope: c.scope, db: opts.oneTransaction ? db : undefined }),
    };
  }

  // Ends the run of fn that failed with err: its writes roll back; the key
  // is released (one transaction: with the claim), or, for a final error,
  // the error is stored so that duplicates get it back.
  async function fail(c, db, err) {
    let keep = false;
    try {
      keep = Boolean(opts.final(err));
    } catch (e) {
      opts.log(`options.final threw: ${e.message}`);
    }
    const body = keep ? JSON.stringify(storedError(err)) : null;
    try {
      await db.query('ROLLBACK');
      if (keep && opts.oneTransaction) await flow.claimAndComplete(db, c, FAILURE, body, null, 'always');
      else if (keep) await flow.client.complete(c.key, c.fence, FAILURE, body, null, { scope: c.scope, db });
      else if (!opts.oneTransaction) await flow.client.release(c.key, c.fence, { scope: c.scope, db });
      flow.checkin(db);
    } catch (e) {
      flow.checkin(db, e);
      opts.log(`could not end the claim after the function failed: ${e.message}`);
    }
  }

  // Two transactions: renews the lease while fn runs (every extendEvery
  // ms, or a third of the lease); returns { stop }.
  function keepLeased(c) {
    let timer = null;
    let stopped = false;
    const renew = () => {
      timer = null;
      flow.client.extend(c.key, c.fence, { scope: c.scope }).then(schedule, (err) => {
        if (err instanceof ClaimLostError) return; // complete will say so
        opts.log(`could not renew the lease: ${err.message}`);
        schedule();
      });
    };
    const schedule = async () => {
      const every = opts.extendEvery ?? (await leaseLength()) / 3;
      if (!stopped) timer = setTimeout(renew, every);
    };
    schedule().catch((err) => opts.log(`could not read the lease: ${err.message}`));
    return {
      stop() {
        stopped = true;
        if (timer) clearTimeout(timer);
      },
    };
  }

  // Resolves to the lease in effect, in milliseconds: the lease option, or
  // the setting idempotency.lease of the pool's role (read once).
  async function leaseLength() {
    if (typeof opts.lease === 'number') return opts.lease;
    if (leaseMs === null) {
      const { rows } = await pool.query(`SELECT extract(epoch FROM coalesce($1::interval,
        pg_catalog.current_setting('idempotency.lease', true)::interval, interval '60 seconds')) * 1000 AS ms`,
      [opts.lease]);
      leaseMs = Number(rows[0].ms);
    }
    return leaseMs;
  }
}

module.exports = {
  idempotent, canonicalJson, argumentsFingerprint,
  IdempotencyInProgressError, IdempotencyMismatchError, IdempotencyStoredError,
};
