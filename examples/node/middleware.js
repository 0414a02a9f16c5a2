'use strict';
// Express middleware: Idempotency-Key on top of the idempotency extension.
//
// For the methods it covers, it reads the body, claims the key in its own
// transaction (committed at once, so that a concurrent retry sees it), opens
// a second transaction for the handler as req.db, and when the handler
// answers, stores the response with idempotency.complete() in that same
// transaction: the business writes and the stored response commit together.

const crypto = require('node:crypto');
const express = require('express');

const DEFAULTS = {
  methods: ['POST', 'PATCH'], // the methods that take a key
  required: true, // 400 when a covered request has no key
  failOpen: false, // when the idempotency calls fail: false = 503, true = run unguarded
  lease: '60 seconds', // longer than the slowest handler
  retention: null, // NULL: the setting idempotency.retention (24h)
  storeHeaders: ['content-type', 'location'], // the headers a replay repeats
  limit: '1mb', // the largest request body read
};

const CLAIM = `
  SELECT outcome, fence, status_code, headers, body, retry_after
    FROM idempotency.claim($1, idempotency.fingerprint($2, $3, $4, $5),
                           scope => $6, lease => $7::interval,
                           retention => $8::interval)`;
const COMPLETE = 'SELECT idempotency.complete($1, $2, $3, $4, $5::jsonb, $6)';
const RELEASE = 'SELECT idempotency.release($1, $2, $3)';

// Returns the middleware; pool is a pg.Pool on the database of the business data.
function idempotency(pool, options = {}) {
  const opts = { ...DEFAULTS, ...options };
  const methods = opts.methods.map((m) => m.toUpperCase());
  const readBody = express.raw({ type: () => true, limit: opts.limit });

  return function idempotencyMiddleware(req, res, next) {
    if (!methods.includes(req.method)) return next();
    readBody(req, res, (err) => {
      if (err) return next(err);
      guard(req, res, next).catch(next);
    });
  };

  // Claims the key and answers, or runs the handler in a transaction.
  async function guard(req, res, next) {
    req.rawBody = Buffer.isBuffer(req.body) ? req.body : Buffer.alloc(0);
    req.body = parseJson(req);
    if (req.body === INVALID) return sendError(res, 400, 'the body is not valid JSON');

    const key = req.get('idempotency-key');
    if (key === undefined && opts.required)
      return sendError(res, 400, 'the Idempotency-Key header is required');

    let client;
    try {
      client = await pool.connect();
    } catch (err) {
      return unavailable(res, err);
    }

    let claim = null;
    if (key !== undefined) {
      const scope = scopeOf(req);
      try {
        const { rows } = await client.query(CLAIM, [key, req.method, ...pathAndQuery(req),
          req.rawBody, scope, opts.lease, opts.retention]);
        claim = { key, scope, ...rows[0] };
      } catch (err) {
        // 22023: the key is empty, too long or has control characters.
        if (err.code === '22023') {
          client.release();
          return sendError(res, 400, 'the Idempotency-Key header is not a valid key');
        }
        if (!opts.failOpen) {
          client.release(err);
          return unavailable(res, err);
        }
        console.error('idempotency: claim failed, running unguarded:', err.message);
      }
      if (claim && claim.outcome !== 'new') {
        client.release();
        return answer(res, claim);
      }
    }

    try {
      await client.query('BEGIN');
    } catch (err) {
      client.release(err);
      return unavailable(res, err);
    }
    req.db = client;
    holdResponse(res, (body) => finish(client, claim, res, body));
    next();
  }

  // Ends the handler's transaction: complete and commit, or roll back and
  // release. Returns true when the handler's response is the one to send.
  async function finish(client, claim, res, body) {
    try {
      if (res.statusCode >= 500) {
        await client.query('ROLLBACK');
        if (claim) await client.query(RELEASE, [claim.key, claim.fence, claim.scope]);
      } else {
        if (claim)
          await client.query(COMPLETE, [claim.key, claim.fence, res.statusCode, body,
            JSON.stringify(headersToStore(res)), claim.scope]);
        await client.query('COMMIT');
      }
      client.release();
      return true;
    } catch (err) {
      await client.query('ROLLBACK').catch(() => {});
      if (err.code === 'IK001') {
        // The lease ran out and a retry took the key over: our writes rolled
        // back, and that retry's answer is the one that counts.
        client.release();
        return replaceResponse(res, 409, 'this request lost its claim to a retry; retry it',
          { 'Retry-After': '1' });
      }
      if (res.statusCode >= 500) {
        // The handler's 500 goes out; the key stays claimed until its lease ends.
        client.release(err);
        return true;
      }
      // Nothing committed: free the key so that a retry runs again.
      if (claim) await client.query(RELEASE, [claim.key, claim.fence, claim.scope]).catch(() => {});
      client.release(err);
      console.error('idempotency: could not store the response:', err.message);
      return replaceResponse(res, 503, 'the database is unavailable; retry later',
        { 'Retry-After': '1' });
    }
  }

  // Picks the response headers that a replay repeats.
  function headersToStore(res) {
    const stored = {};
    for (const name of opts.storeHeaders) {
      const value = res.getHeader(name);
      if (value !== undefined)
        stored[name] = Array.isArray(value) ? value.map(String) : String(value);
    }
    return stored;
  }
}

const INVALID = Symbol('invalid JSON');

// Parses a JSON body into req.body, as express.json() would have.
function parseJson(req) {
  if (req.rawBody.length === 0 || !req.is('json')) return req.rawBody;
  try {
    return JSON.parse(req.rawBody.toString('utf8'));
  } catch {
    return INVALID;
  }
}

// Returns the caller's scope: a hash of its credential, never the credential.
function scopeOf(req) {
  for (const name of ['authorization', 'x-api-key']) {
    const credential = req.get(name);
    if (credential !== undefined)
      return crypto.createHash('sha256').update(`${name}:${credential}`).digest('hex');
  }
  return '';
}

// Splits the request URL into path and query (null when there is none).
function pathAndQuery(req) {
  const url = req.originalUrl;
  const q = url.indexOf('?');
  if (q < 0 || q === url.length - 1) return [q < 0 ? url : url.slice(0, q), null];
  return [url.slice(0, q), url.slice(q + 1)];
}

// Answers a claim that did not win: replay, in_progress or mismatch.
function answer(res, claim) {
  switch (claim.outcome) {
    case 'replay':
      res.status(claim.status_code);
      for (const [name, value] of Object.entries(claim.headers ?? {})) res.setHeader(name, value);
      res.setHeader('Idempotent-Replayed', 'true');
      return res.end(claim.body ?? Buffer.alloc(0));
    case 'in_progress':
      return sendError(res, 409, 'a request with this Idempotency-Key is in progress',
        { 'Retry-After': String(claim.retry_after) });
    case 'mismatch':
      return sendError(res, 422, 'this Idempotency-Key was used with a different request');
    default:
      throw new Error(`unexpected claim outcome ${claim.outcome}`);
  }
}

// Buffers what the handler writes; sends it if onEnd(body) resolves to true.
function holdResponse(res, onEnd) {
  const { write, end } = res;
  const chunks = [];
  const collect = (chunk, encoding) => {
    if (chunk === undefined || chunk === null || typeof chunk === 'function') return;
    if (typeof encoding !== 'string') encoding = 'utf8';
    chunks.push(Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, encoding));
  };
  res.write = (chunk, encoding) => {
    collect(chunk, encoding);
    return true;
  };
  res.end = (chunk, encoding) => {
    collect(chunk, encoding);
    res.write = write;
    res.end = end;
    const body = Buffer.concat(chunks);
    onEnd(body).then(
      (send) => { if (send) res.end(body); },
      (err) => { console.error('idempotency:', err); res.destroy(err); });
    return res;
  };
}

// Replaces the handler's response with an error; returns false (do not send it).
function replaceResponse(res, status, message, headers = {}) {
  if (res.headersSent) {
    res.destroy(); // too late to change: the client sees a failure and retries
    return false;
  }
  for (const name of res.getHeaderNames()) res.removeHeader(name);
  sendError(res, status, message, headers);
  return false;
}

// Fails closed: without the database, a retry could run twice.
function unavailable(res, err) {
  console.error('idempotency: database unavailable:', err.message);
  return sendError(res, 503, 'the database is unavailable; retry later', { 'Retry-After': '1' });
}

// Sends a JSON error.
function sendError(res, status, message, headers = {}) {
  res.status(status).set(headers).json({ error: message });
}

module.exports = idempotency;
