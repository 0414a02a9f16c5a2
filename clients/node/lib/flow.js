'use strict';
// The flow every entry point of pg-idempotency shares (the Express
// middleware, the idempotent function): connections checked out and back,
// the claim with the BEGIN of the work's transaction (one transaction: the
// claim inside it; two: the claim commits on its own first), asked again
// with the same token while its answer is lost, complete with COMMIT in one
// round trip, traced. Statements that can travel together do (pipelined,
// pg 8.23 or later).

const crypto = require('node:crypto');
const {
  IdempotencyClient, ClaimLostError, interval, claimText, completeText, claimFromRow,
  PREPARE, executeClaimText, executeCompleteText,
} = require('./client');
const { traced, describeClaim, describeComplete } = require('./telemetry');

// Claims the key again and completes it in one statement (after the work
// rolled back with its claim, one transaction).
const CLAIM_AND_COMPLETE = `SELECT idempotency.complete($1, c.fence, $3, $4, $5::jsonb, $6) AS result
  FROM idempotency.claim($1, $2, scope => $6, lease => $7::interval, retention => $8::interval) AS c
 WHERE c.outcome OPERATOR(pg_catalog.=) 'new'`;
// The same, only when idempotency.store_server_errors is on (a one-time
// filter: otherwise the claim is not even called): a 5xx kept for replay.
const KEEP_SERVER_ERROR = `${CLAIM_AND_COMPLETE}
   AND pg_catalog.current_setting('idempotency.store_server_errors', true)::boolean`;

// True for a wait above zero: a number of milliseconds, or an interval's
// text with a digit other than 0 and nothing that negates it (a minus sign,
// "ago"): the extension would refuse a negative wait at every claim.
function positive(wait) {
  if (typeof wait === 'number') return wait > 0;
  const text = String(wait);
  return /[1-9]/.test(text) && !/-|ago/i.test(text);
}

// True when err is not the server's answer to a statement but a lost
// connection (a socket error, "Connection terminated unexpectedly", a
// connection-class or shutdown SQLSTATE): what the statement did is not known.
function connectionLost(err) {
  if (err instanceof ClaimLostError) return false; // IK001, wrapped
  if (typeof err?.severity !== 'string') return true;
  return /^(08|57P0)/.test(err.code ?? '');
}

// The connections on which the middleware's PREPARE ran (the prepare option).
const prepared = new WeakSet();

// True when err says a prepared statement is gone from its connection
// (DISCARD ALL or DEALLOCATE ran there): the statement did not run.
function statementsGone(err) {
  return err?.code === '26000';
}

// Ignores an 'error' event of a checked-out connection: the statement in
// flight rejects with the same error, which is where it is handled.
function onDropped() {}

// Waits ms milliseconds.
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// Runs calls, each of which sends one statement on db, so that they travel
// together when the client pipelines (pg 8.23 or later: one round trip for
// all), else one after another; resolves to their outcomes as
// Promise.allSettled does. Pipelined or not, every statement is sent, as
// the server would run it after a failed one: a COMMIT after a failed
// complete rolls back.
async function together(db, calls) {
  if (typeof db.pipeline !== 'boolean') {
    const outcomes = [];
    for (const call of calls) {
      try {
        outcomes.push({ status: 'fulfilled', value: await call() });
      } catch (reason) {
        outcomes.push({ status: 'rejected', reason });
      }
    }
    return outcomes;
  }
  const was = db.pipeline;
  db.pipeline = true; // until every answer is in: pg reads the answers of what it sent in pipeline mode
  try {
    return await Promise.allSettled(inOneWrite(db, () => calls.map((call) => call())));
  } finally {
    db.pipeline = was;
  }
}

// Runs send(), which queues statements on db, with db's socket corked, so
// that they leave in one write (as pg does with the messages of one
// statement): one system call for the client and one read for the server,
// instead of one each. Returns what send() returns.
function inOneWrite(db, send) {
  const socket = db.connection?.stream;
  if (typeof socket?.cork !== 'function' || typeof socket.uncork !== 'function') return send();
  socket.cork();
  try {
    return send();
  } finally {
    socket.uncork();
  }
}

// Returns the values of outcomes, or throws the first failure among them.
function valuesOf(outcomes) {
  const failed = outcomes.find((o) => o.status === 'rejected');
  if (failed) throw failed.reason;
  return outcomes.map((o) => o.value);
}

// Returns { db, open }: db is the connection while the work's transaction
// lasts (open); afterwards (a timeout answered, the connection went back to
// the pool) its queries fail instead of running in whatever transaction the
// connection is in by then.
function transactionHandle(db) {
  const handle = { open: true };
  const query = (...args) => {
    if (handle.open) return db.query(...args);
    const err = new Error('pg-idempotency: this transaction has ended (its response was sent, its function ' +
      'returned, or a timeout answered it); the query was not run');
    const callback = args.find((a) => typeof a === 'function');
    if (callback) return void process.nextTick(callback, err);
    return Promise.reject(err);
  };
  handle.db = new Proxy(db, {
    get(target, name) {
      if (name === 'query') return query;
      if (name === 'release') return undefined; // the middleware gives the connection back
      const value = Reflect.get(target, name, target);
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
  return handle;
}

// The flow on one pool, with options: lease, retention, wait (intervals or
// null), oneTransaction, prepare, retries, retryDelay, log, tracerProvider,
// claimColumns (what the claim answers, not prepared; default the HTTP layer's).
class Flow {
  constructor(pool, opts) {
    this.pool = pool;
    this.opts = opts;
    this.client = new IdempotencyClient(pool, {
      lease: opts.lease, retention: opts.retention, tracerProvider: opts.tracerProvider,
    });
    this.tracer = this.client.tracer;
    this.pipelinedBefore = new WeakMap(); // a connection pipelining for a while => its pipeline setting before
  }

  // Returns the state of one unit of work: its key, scope and fingerprint,
  // and a claim token of its own.
  static work(key, scope, fp) {
    return { key, scope, fp, token: crypto.randomUUID(), reruns: 0 };
  }

  // Checks a connection out of the pool (for the middleware's statements:
  // with them prepared, per the prepare option); one that drops meanwhile
  // must not end the process.
  async checkout({ forStatements = true } = {}) {
    const db = await this.pool.connect();
    db.on('error', onDropped);
    if (this.opts.prepare && forStatements && !prepared.has(db)) {
      try {
        await this.prepareOn(db);
      } catch (err) {
        this.checkin(db, err);
        throw err;
      }
      prepared.add(db);
    }
    return db;
  }

  // Prepares the middleware's statements on db, each unless it already is
  // (42P05: a copy of this module that shares the pool prepared it).
  async prepareOn(db) {
    for (const statement of PREPARE) {
      try {
        await db.query(statement);
      } catch (err) {
        if (err.code !== '42P05') throw err;
      }
    }
  }

  // Gives a connection back, or discards it when err says it is lost.
  checkin(db, err) {
    if (this.pipelinedBefore.has(db)) {
      db.pipeline = this.pipelinedBefore.get(db);
      this.pipelinedBefore.delete(db);
    }
    if (err && connectionLost(err)) return db.release(err); // still listening: it may emit again
    db.removeListener('error', onDropped);
    db.release();
  }

  // Ends the transaction db is in, if any (a pipelined COMMIT after a failed
  // statement has ended it already), and gives the connection back. The
  // status is the last ReadyForQuery's, and pg rejects a failed statement
  // at its error, which the server sends ahead of that ReadyForQuery: until
  // the client is ready again, an idle status may be stale ("BEGIN; claim"
  // failed: the transaction is open, aborted), so ROLLBACK then.
  async rollbackAndCheckin(db, cause = null) {
    if (statementsGone(cause)) prepared.delete(db); // the next checkout prepares them again
    if (typeof db.getTransactionStatus === 'function' && db.getTransactionStatus() === 'I' &&
        db.readyForQuery === true)
      return this.checkin(db);
    try {
      await db.query('ROLLBACK');
      this.checkin(db);
    } catch (err) {
      this.checkin(db, err);
    }
  }

  // Returns the text of the claim of request c (its arguments as literals,
  // so that it can share a simple query with BEGIN).
  claimSql(c) {
    return (this.opts.prepare ? executeClaimText : claimText)(c.key, c.fp, {
      scope: c.scope, lease: this.opts.lease, retention: this.opts.retention, wait: this.opts.wait, token: c.token,
      columns: this.opts.claimColumns,
    });
  }

  // Sends BEGIN and the claim of c on db as one simple query (one round
  // trip); resolves to the claim.
  beginAndClaim(db, c) {
    return traced(this.tracer, 'idempotency.claim', c.key,
      () => db.query(`BEGIN; ${this.claimSql(c)}`).then((results) => claimFromRow(results[1].rows[0])), describeClaim);
  }

  // Sends one claim of c on db, with the BEGIN of the handler's transaction:
  // one transaction: BEGIN, then the claim in it, in one simple query; two:
  // the claim on its own (it commits at once), then BEGIN: pipelined (pg
  // 8.23 or later) both at once, and a claim that is not new rolls the
  // empty transaction back; otherwise BEGIN only after new.
  // Resolves to { claim, open } (open: db is in a transaction).
  async claimOn(db, c) {
    if (this.opts.oneTransaction) return { claim: await this.beginAndClaim(db, c), open: true };
    const claim = () => traced(this.tracer, 'idempotency.claim', c.key,
      () => db.query(this.claimSql(c)).then((r) => claimFromRow(r.rows[0])), describeClaim);
    const begin = () => db.query('BEGIN');
    if (typeof db.pipeline === 'boolean') {
      const [got] = valuesOf(await together(db, [claim, begin]));
      return { claim: got, open: true };
    }
    const got = await claim();
    if (got.outcome === 'new') await begin();
    return { claim: got, open: got.outcome === 'new' };
  }

  // Claims on a fresh connection, asking again with the same token (at most
  // this.opts.retries times in all, counting from attempt) while the answer is
  // lost: a claim that committed unheard answers new again. Resolves to
  // { claim, db, open }; when new, db is in the transaction the handler gets.
  async claimRecovering(c, first = 0) {
    for (let attempt = first; ; attempt++) {
      if (attempt > 0) await sleep(this.opts.retryDelay * 2 ** (attempt - 1));
      let db = null;
      try {
        db = await this.checkout();
        return { db, ...await this.claimOn(db, c) };
      } catch (err) {
        if (db) {
          if (connectionLost(err)) this.checkin(db, err);
          else await this.rollbackAndCheckin(db, err);
        }
        if (!(connectionLost(err) || statementsGone(err)) || attempt >= this.opts.retries) throw err;
        if (connectionLost(err)) {
          c.claimLost = true;
          this.opts.log(`the claim's answer was lost (${err.message}); asking again`);
        }
      }
    }
  }

  // Gives back the connection of a claim (claimOn's { db, open }) whose
  // work does not run: its empty transaction, if open, rolls back.
  giveBack({ db, open }) {
    return open ? this.rollbackAndCheckin(db) : this.checkin(db);
  }

  // Ends c's work on db (c null: work run unguarded, a COMMIT only) and
  // gives the connection back. Resolves to null when it committed, or to
  // the error when the COMMIT's answer was lost (the connection is
  // discarded; reclaim tells what happened). Rejects with the error when
  // it failed: rolled back, and in two transactions the key released
  // (unless IK001: a retry owns it).
  async commitWork(db, c, statusCode, body, headers) {
    try {
      if (c) await this.completeAndCommit(db, c, statusCode, body, headers);
      else await db.query('COMMIT');
      this.checkin(db);
      return null;
    } catch (err) {
      if (connectionLost(err)) {
        this.checkin(db, err);
        return err;
      }
      await this.rollbackAndCheckin(db, err);
      if (c && !this.opts.oneTransaction && err.code !== 'IK001')
        await this.client.release(c.key, c.fence, { scope: c.scope }).catch(() => {});
      throw err;
    }
  }

  // After a COMMIT (or, from first on, a claim) whose answer was lost:
  // claims again with c's token to learn what happened (rejects when the
  // database cannot tell). Resolves to { claim, db }. A new claim means
  // nothing of c's work committed: when rerun allows and fewer than
  // retries reruns have run (this one is counted), db is in the new
  // claim's transaction for the work to run again; otherwise db is null:
  // the connection went back and, new, the key was released.
  async reclaim(c, { first = 0, rerun = true } = {}) {
    const got = await this.claimRecovering(c, first);
    const { claim } = got;
    if (claim.outcome === 'new') {
      c.fence = claim.fence; // the same, unless the lease had ended (a takeover) or, one transaction, it rolled back
      if (rerun && c.reruns < this.opts.retries) {
        c.reruns += 1;
        this.opts.log('the transaction of the work was lost before it committed; running it again');
        return { claim, db: got.db };
      }
    }
    await this.giveBack(got);
    if (claim.outcome === 'new' && !this.opts.oneTransaction)
      await this.client.release(c.key, claim.fence, { scope: c.scope }).catch(() => {});
    return { claim, db: null };
  }

  // Sends complete and COMMIT in one simple query (one round trip); a
  // complete that fails skips the COMMIT and leaves the transaction to roll back.
  completeAndCommit(db, c, statusCode, body, headers) {
    const complete = this.opts.prepare ? executeCompleteText : completeText;
    const sql = `${complete(c.key, c.fence, statusCode, body, headers, c.scope)}; COMMIT`;
    return traced(this.tracer, 'idempotency.complete', c.key,
      () => db.query(sql).then((results) => results[0].rows[0].result), describeComplete);
  }

  // One transaction, after the work rolled back with its claim: stores its
  // answer by claiming the key again and completing it in one statement:
  // always when keep is 'always', else (a 5xx) only when
  // idempotency.store_server_errors is on; otherwise (no row) it is
  // released, as complete would answer.
  claimAndComplete(on, c, statusCode, body, headers, keep = 'server error') {
    return traced(this.tracer, 'idempotency.complete', c.key,
      () => on.query(keep === 'always' ? CLAIM_AND_COMPLETE : KEEP_SERVER_ERROR,
        [c.key, c.fp, statusCode, body, headers === null ? null : JSON.stringify(headers), c.scope, interval(this.opts.lease),
          interval(this.opts.retention)]).then((r) => r.rows[0]?.result ?? 'released'),
      describeComplete);
  }

  // Runs db's statements pipelined until it is checked in (pg 8.23 or later).
  pipelineUntilCheckin(db) {
    this.pipelinedBefore.set(db, db.pipeline);
    db.pipeline = true;
  }

}

module.exports = {
  Flow, positive, connectionLost, statementsGone, together, inOneWrite, sleep, transactionHandle,
};
