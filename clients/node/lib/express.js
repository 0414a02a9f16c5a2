'use strict';
// Express middleware for Idempotency-Key (docs/http-contract.md of the
// idempotency extension): for the methods it covers it reads the body,
// claims the key, runs the handler in a transaction given as req.db, and
// stores the response with idempotency.complete() in that same transaction,
// so the business writes and the stored response commit together or not at
// all. By default the claim commits on its own first (a concurrent retry
// sees it at once, a crashed request's key is taken over when its lease
// ends); with oneTransaction the claim is in the handler's transaction too.
// The claim, complete and connection handling are the shared flow (flow.js).

const { fingerprint, sha256 } = require('./fingerprint');
const { idempotencyKeyOf } = require('./key');
const {
  Flow, positive, connectionLost, statementsGone, together, inOneWrite, transactionHandle,
} = require('./flow');
const { ReplayCache } = require('./replay-cache');
const { httpAnswers } = require('./http-answers');
const { tracedReplayFromMemory } = require('./telemetry');

const DEFAULTS = {
  methods: ['POST', 'PATCH'], // the methods that take a key
  required: true, // 400 when a covered request has no key; false: run it unguarded
  failOpen: false, // when an idempotency call fails: false = 503, true = run unguarded
  lease: null, // null: the setting idempotency.lease (60s); longer than the slowest handler: then a retry takes over
  retention: null, // null: the setting idempotency.retention (24h)
  storeHeaders: ['content-type', 'location'], // the response headers a replay repeats
  limit: 1024 * 1024, // the largest request body read, in bytes
  scope: credentialScope, // (req) => the caller's scope
  problemTypes: {}, // code => the URI of its problem type (default about:blank)
  log: (message) => console.error(`pg-idempotency: ${message}`),
  retries: 3, // how many times a claim whose answer was lost is asked again, then 503
  retryDelay: 50, // milliseconds before the first ask again, doubled each time
  oneTransaction: false, // true: the claim, the handler's writes and complete in one transaction
  wait: undefined, // how long a concurrent duplicate waits for the first (one transaction: 2 s)
  runAhead: true, // one transaction, pg 8.23+: run the handler while the claim's answer is on its way
  prepare: false, // true: claim and complete as SQL prepared statements (not through a transaction pooler)
  cache: true, // replays from memory: false, true (the defaults below) or { max, maxBytes, maxEntryBytes }
  tracerProvider: null, // where the spans go: null = OpenTelemetry's global tracer provider
  key: idempotencyKeyOf, // (req) => the key; undefined: none sent; null: malformed
  verify: null, // (req) => throws when the request is not authentic (a webhook's signature): 401, nothing claimed
  redact: null, // ({ status, headers, body }) => what to store instead; the live response is unchanged
};

// How long, by default, a duplicate of a request running in one transaction waits for it.
const ONE_TRANSACTION_WAIT = '2 seconds';

// The detail of a 503 after a lost COMMIT whose outcome the database could not tell.
const UNKNOWN = 'The connection to the database was lost while this request was committed; ' +
  'whether it took effect is not known. Retry with the same Idempotency-Key.';


// Returns the scope of a request: the SHA-256 of its credential, '' without
// one, over the header's bytes as sent (Node reads header bytes as latin1),
// as every client computes it.
function credentialScope(req) {
  for (const name of ['authorization', 'x-api-key']) {
    const credential = req.headers[name];
    if (credential !== undefined)
      return sha256(Buffer.from(`${name}:${credential}`, 'latin1'), 'hex');
  }
  return '';
}

// Splits the request URL into its path and query (null when there is none).
function pathAndQuery(req) {
  const url = req.originalUrl ?? req.url;
  const q = url.indexOf('?');
  if (q < 0) return [url, null];
  return [url.slice(0, q), q === url.length - 1 ? null : url.slice(q + 1)];
}

// Returns an error that Express answers with the given status.
function httpError(status, message) {
  return Object.assign(new Error(message), { status, statusCode: status, expose: true });
}

// Reads the whole request body (the fingerprint needs its exact bytes).
function readBody(req, limit) {
  if (req._body === true || req.readableEnded)
    return Promise.reject(new Error('pg-idempotency: the request body was already read; ' +
      'mount the middleware before any body parser'));
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on('data', (chunk) => {
      size += chunk.length;
      if (size > limit) {
        req.removeAllListeners('data');
        req.resume();
        reject(httpError(413, 'request entity too large'));
      } else {
        chunks.push(chunk);
      }
    });
    req.on('end', () => resolve(chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, size)));
    req.on('error', reject);
  });
}

// Parses a JSON body into req.body, as express.json() would; other bodies stay raw.
function parseBody(req) {
  const raw = req.rawBody;
  if (raw.length === 0) return undefined;
  if (!/^\s*application\/([^;\s]*\+)?json\s*(;|$)/i.test(req.headers['content-type'] ?? ''))
    return raw;
  try {
    return JSON.parse(raw.toString('utf8'));
  } catch {
    throw httpError(400, 'the request body is not valid JSON');
  }
}

// Buffers what the handler writes; when it ends, sends it if onEnd(body) resolves to true.
function holdResponse(res, onEnd) {
  const { write, end } = res;
  const chunks = [];
  const collect = (chunk, encoding) => {
    if (chunk === undefined || chunk === null || typeof chunk === 'function') return;
    chunks.push(Buffer.isBuffer(chunk) ? chunk
      : Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8'));
  };
  res.write = (chunk, encoding) => {
    collect(chunk, encoding);
    return true;
  };
  res.end = (chunk, encoding) => {
    collect(chunk, encoding);
    res.write = write;
    res.end = end;
    const body = chunks.length === 1 ? chunks[0] : Buffer.concat(chunks);
    onEnd(body).then(
      (send) => { if (send) res.end(body); },
      (err) => res.destroy(err));
    return res;
  };
}

// Returns the Express middleware; pool is a pg.Pool on the database of the business data.
function idempotency(pool, options = {}) {
  if (!pool || typeof pool.connect !== 'function') throw new TypeError('idempotency() needs a pg.Pool');
  const opts = { ...DEFAULTS, ...options };
  const methods = new Set(opts.methods.map((m) => m.toUpperCase()));
  const wait = opts.wait ?? (opts.oneTransaction ? ONE_TRANSACTION_WAIT : null);
  const flow = new Flow(pool, { ...opts, wait });
  const { client, tracer } = flow;
  const {
    problem, replaceWith, replaceResponse, answer, answerClaimedAgain, invalidKey, unavailable, claimLost,
    toStore, redactFailed,
  } = httpAnswers(opts);
  if (opts.oneTransaction && !positive(wait))
    throw new TypeError('idempotency(): oneTransaction needs a positive wait ' +
      '(a duplicate would otherwise wait for the first without a bound)');
  const cache = opts.cache ? new ReplayCache(opts.cache === true ? {} : opts.cache) : null;
  // pg emits 'error' on the pool when an idle connection drops: without a
  // listener that would end the process. Logged unless the application listens too.
  pool.on('error', (err) => {
    if (pool.listenerCount('error') === 1) opts.log(`an idle connection was lost: ${err.message}`);
  });

  return function idempotencyMiddleware(req, res, next) {
    if (!methods.has(req.method)) return next();
    readBody(req, opts.limit)
      .then((raw) => {
        req.rawBody = raw;
        req.body = parseBody(req);
        return guard(req, res, next);
      })
      .catch(next);
  };

  // Claims the key and answers, or runs the handler in a transaction.
  async function guard(req, res, next) {
    if (opts.verify && !await verified(req, res)) return undefined;
    const key = opts.key(req);
    if (key === undefined) {
      if (opts.required)
        return problem(res, 400, 'idempotency_key_missing', 'This request needs an Idempotency-Key header.');
      return runHandler(req, res, next);
    }
    if (typeof key !== 'string' || key === '') return invalidKey(res);

    const [path, query] = pathAndQuery(req);
    const c = Flow.work(key, opts.scope(req), fingerprint(req.method, path, req.rawBody.length > 0 ? req.rawBody : null, query));
    const remembered = cache?.get(c.scope, c.key, c.fp);
    if (remembered) {
      tracedReplayFromMemory(tracer, c.key);
      return answer(res, remembered);
    }
    if (opts.oneTransaction && opts.runAhead && !opts.failOpen) {
      const db = await flow.checkout().catch(() => null); // none: claimRecovering tries again
      if (db && answeredMeanwhile(req, res)) return flow.checkin(db);
      if (db && typeof db.pipeline === 'boolean') return runAhead(req, res, next, c, db);
      if (db) flow.checkin(db);
    }
    let got;
    try {
      got = await flow.claimRecovering(c);
    } catch (err) {
      if (err.code === '22023') return invalidKey(res); // a key the extension refuses
      if (!opts.failOpen) return unavailable(res, err);
      opts.log(`claim failed, running unguarded: ${err.message}`);
      return runHandler(req, res, next);
    }
    if (got.claim.outcome !== 'new') {
      answerClaimedAgain(res, c, got.claim); // the answer goes out first; the empty transaction ends after
      if (got.claim.outcome === 'replay') remember(c, got.claim);
      return flow.giveBack(got);
    }
    c.fence = got.claim.fence;
    if (answeredMeanwhile(req, res)) { // the handler does not run: nothing to keep
      await flow.rollbackAndCheckin(got.db);
      if (!opts.oneTransaction) await client.release(c.key, c.fence, { scope: c.scope }).catch(() => {});
      return undefined;
    }
    return handOver(req, res, next, c, got.db, next);
  }

  // True when opts.verify accepts the request; otherwise answers 401 (nothing is claimed).
  async function verified(req, res) {
    try {
      await opts.verify(req);
      return true;
    } catch (err) {
      problem(res, 401, 'webhook_unverified', `The request could not be verified: ${err.message}.`);
      return false;
    }
  }

  // True when the request was answered while the middleware waited for the
  // database (a timeout middleware's answer): its handler must not run.
  function answeredMeanwhile(req, res) {
    return Boolean(req.timedout) || res.headersSent || res.writableEnded;
  }

  // One transaction, when the client pipelines: sends BEGIN and the claim
  // and runs the handler at once, its statements pipelined behind the
  // claim, so that the claim costs no round trip of its own. Everything the
  // handler does is in the claim's transaction: unless the claim answers
  // new, it all rolls back and the claim's answer goes out instead (see
  // settleClaim). Only for handlers whose effects are all in the database.
  // The claim leaves in one write with the statement the handler sends
  // first, when it sends one before it awaits anything.
  function runAhead(req, res, next, c, db) {
    flow.pipelineUntilCheckin(db); // for the whole request: the handler's statements follow the claim unanswered
    return inOneWrite(db, () => {
      c.pending = flow.beginAndClaim(db, c);
      c.pending.catch(() => {}); // awaited when the handler has answered
      return handOver(req, res, next, c, db, next);
    });
  }

  // After a handler that ran ahead of its claim answered: waits for the
  // claim. Resolves to undefined when it is new (go on), else to what
  // finish resolves to, the handler's transaction rolled back: the claim's
  // answer (replay, 409, 422), 400 for a key the extension refuses, 503
  // when it failed, or, when its answer was lost, what asking again says.
  async function settleClaim(req, res, next, c, db) {
    const pending = c.pending;
    c.pending = null;
    let claim;
    try {
      claim = await pending;
    } catch (err) {
      if (connectionLost(err)) {
        flow.checkin(db, err);
        c.claimLost = true;
        return recover(req, res, next, c, 1);
      }
      await flow.rollbackAndCheckin(db, err);
      if (statementsGone(err)) return recover(req, res, next, c, 1); // nothing ran: run it again
      if (err.code === '22023') return replaceWith(res, () => invalidKey(res));
      return replaceWith(res, () => unavailable(res, err));
    }
    if (claim.outcome === 'new') {
      c.fence = claim.fence;
      return undefined;
    }
    await flow.rollbackAndCheckin(db);
    if (claim.outcome === 'replay') remember(c, claim);
    return replaceWith(res, () => answer(res, claim));
  }

  // Keeps a replay read from the database in the cache, until its record
  // expires: looks the record up (after the answer went out, off its path)
  // for its expires_at, and keeps it only if it is the one replayed.
  function remember(c, claim) {
    if (!cache) return;
    client.lookup(c.key, { scope: c.scope }).then((record) => {
      if (record?.state === 'completed' && Buffer.from(c.fp).equals(record.fingerprint) &&
          record.statusCode === claim.statusCode)
        cache.set(c.scope, c.key, c.fp, { ...claim, expiresAt: record.expiresAt });
    }, (err) => opts.log(`could not look a replay up to keep it: ${err.message}`));
  }

  // Runs the handler unguarded, in a transaction (req.db).
  async function runHandler(req, res, next) {
    let db = null;
    try {
      db = await flow.checkout({ forStatements: false });
      await db.query('BEGIN');
    } catch (err) {
      if (db) flow.checkin(db, err);
      return unavailable(res, err);
    }
    return handOver(req, res, next, null, db, next);
  }

  // Gives the handler its transaction (req.db), runs it by dispatch(), and
  // holds its response until it is committed.
  function handOver(req, res, next, c, db, dispatch) {
    const handle = transactionHandle(db);
    req.db = handle.db;
    holdResponse(res, (body) => {
      handle.open = false; // what the handler sends after this is not part of the request
      return finish(req, res, next, c, db, body);
    });
    dispatch();
  }

  // Ends the handler's transaction: complete and commit, or (5xx, or an
  // answer the handler did not give: a timeout's) roll back and abandon.
  // Resolves to true when the handler's response is the one to send.
  async function finish(req, res, next, c, db, body) {
    if (c?.pending) {
      const settled = await settleClaim(req, res, next, c, db);
      if (settled !== undefined) return settled;
    }
    if (res.statusCode >= 500 || req.timedout) return abandon(req, db, c, res, body);
    if (c) {
      try {
        c.stored = toStore(res, body);
      } catch (err) {
        await abandon(req, db, c, res, body, { release: true });
        return redactFailed(res, err);
      }
    }
    let lost;
    try {
      lost = await flow.commitWork(db, c, c?.stored.status, c?.stored.body, c?.stored.headers);
    } catch (err) {
      if (err.code === 'IK001') return claimLost(res);
      opts.log(`could not store the response: ${err.message}`);
      return replaceResponse(res, 503, 'idempotency_unavailable',
        'The response could not be stored; nothing was kept. Retry later.', { 'Retry-After': '1' });
    }
    if (!lost) return true;
    if (c) return recover(req, res, next, c);
    return replaceResponse(res, 503, 'idempotency_unavailable', UNKNOWN, { 'Retry-After': '1' });
  }

  // The connection was lost before the COMMIT's answer came: claims with the
  // same token to learn what happened (flow.reclaim). replay: it committed
  // (the stored response is the handler's), or, in one transaction, a
  // duplicate's committed after ours rolled back (its response goes out, as
  // a replay); new: it rolled back, so the handler runs again.
  async function recover(req, res, next, c, first = 0) {
    let got;
    try {
      got = await flow.reclaim(c, { first, rerun: !res.headersSent && Boolean(req.route) && !req.timedout });
    } catch (err) {
      opts.log(`the COMMIT's answer was lost and the database cannot tell: ${err.message}`);
      return replaceResponse(res, 503, 'idempotency_unavailable', UNKNOWN, { 'Retry-After': '1' });
    }
    const { claim, db } = got;
    if (db) return runAgain(req, res, next, c, db);
    // Asked again for a claim whose answer never came (first > 0: running
    // ahead, nothing of it committed): its answer is the claim's own.
    if (first > 0 && claim.outcome !== 'new') return replaceWith(res, () => answerClaimedAgain(res, c, claim));
    switch (claim.outcome) {
      case 'replay': {
        const { status, body: stored } = c.stored;
        if (claim.statusCode === status && claim.body !== null && stored.equals(claim.body)) return true;
        return replaceWith(res, () => answer(res, claim));
      }
      case 'in_progress': // the lease ended meanwhile and a retry took the key over
        return claimLost(res);
      case 'new': // it may not run again
        if (req.timedout) return true; // a timeout answered: its answer goes out
        return replaceResponse(res, 503, 'idempotency_unavailable',
          'The connection to the database was lost; nothing of this request was kept. Retry later.',
          { 'Retry-After': '1' });
      default:
        return replaceResponse(res, 503, 'idempotency_unavailable', UNKNOWN, { 'Retry-After': '1' });
    }
  }

  // Runs the handler again, on db in its new claim's transaction; resolves
  // to false: the run again sends its own response.
  function runAgain(req, res, next, c, db) {
    for (const name of res.getHeaderNames()) res.removeHeader(name);
    res.statusCode = 200;
    res.statusMessage = undefined;
    handOver(req, res, next, c, db, () => req.route.dispatch(req, res, next));
    return false;
  }

  // Rolls back the writes of a 5xx handler (or of one a timeout answered
  // for, or whose response redact could not prepare: release), then ends
  // the claim: two transactions: complete with the 5xx,
  // which releases the key (or, with idempotency.store_server_errors on,
  // stores the response for replay); one transaction: the claim rolled
  // back with the rest, and the 5xx is kept only with that setting on. An
  // answer the handler did not give by finishing (req.timedout) is never
  // stored: the key is released. The answer goes out either way. When the
  // connection is lost, the transaction is gone with it: what is left goes
  // through the pool.
  async function abandon(req, db, c, res, body, { release = Boolean(req.timedout) } = {}) {
    let stored = null;
    if (c && !release) {
      try {
        stored = toStore(res, body);
      } catch (err) {
        opts.log(`the ${res.statusCode} is not stored: ${err.message}`);
        release = true;
      }
    }
    const end = (on) => {
      if (!c) return null;
      if (release) return opts.oneTransaction ? null : client.release(c.key, c.fence, { db: on, scope: c.scope });
      if (opts.oneTransaction) return flow.claimAndComplete(on, c, stored.status, stored.body, stored.headers);
      return client.complete(c.key, c.fence, stored.status, stored.body, stored.headers, { db: on, scope: c.scope });
    };
    const [rolledBack, ended] = await together(db, [() => db.query('ROLLBACK'), () => end(db)]);
    let broken = rolledBack.status === 'rejected' ? rolledBack.reason : undefined;
    let failure = ended.status === 'rejected' ? ended.reason : undefined;
    if (broken && connectionLost(broken) && failure && connectionLost(failure)) {
      try {
        await end(pool); // the connection went with the transaction
        failure = undefined;
      } catch (err) {
        failure = err;
      }
    }
    if (failure && failure.code !== 'IK001') { // IK001: a retry owns the key, nothing of ours to free
      opts.log(`could not end the claim after a ${res.statusCode}: ${failure.message}`);
      if (!connectionLost(failure) && c && !opts.oneTransaction)
        await client.release(c.key, c.fence, { scope: c.scope }).catch(() => {});
      else if (!broken) broken = failure; // the key frees itself when its lease ends
    }
    flow.checkin(db, broken);
    return true;
  }
}

module.exports = { idempotency, credentialScope };
