'use strict';
// The middleware's HTTP answers (docs/http-contract.md): replays, RFC 9457
// problems (409, 422, 400, 503) and the responses that replace a handler's.

// RFC 9110's reason phrases of the statuses the middleware answers with.
const TITLES = {
  400: 'Bad Request', 401: 'Unauthorized', 409: 'Conflict', 422: 'Unprocessable Content',
  500: 'Internal Server Error', 503: 'Service Unavailable',
};

// The redact option threw or returned something else than a response to store.
class RedactError extends Error {
  constructor(message, cause) {
    super(`pg-idempotency: ${message}`, { cause });
    this.name = 'RedactError';
  }
}

// Replaces the handler's response with what send() sends; resolves to false (do not send the handler's).
function replaceWith(res, send) {
  if (res.headersSent) {
    res.destroy(); // too late to change: the client sees a failure and retries
    return false;
  }
  for (const name of res.getHeaderNames()) res.removeHeader(name);
  send();
  return false;
}

// Returns the answers of a middleware with options opts (problemTypes,
// storeHeaders, oneTransaction, log).
function httpAnswers(opts) {
  // Answers 409: the lease ended and a retry took the key over; the handler's writes rolled back.
  function claimLost(res) {
    return replaceResponse(res, 409, 'idempotency_claim_lost',
      'This request ran past its lease and a retry took it over; its writes were rolled back.',
      { 'Retry-After': '1' });
  }

  // Picks the response headers that a replay repeats: storeHeaders, and
  // Content-Encoding always, as the stored body is encoded by it.
  function headersToStore(res) {
    const stored = {};
    for (const name of new Set([...opts.storeHeaders, 'content-encoding'])) {
      const value = res.getHeader(name);
      if (value !== undefined) stored[name] = Array.isArray(value) ? value.map(String) : String(value);
    }
    return stored;
  }

  // Returns what complete stores of the handler's response (body: its bytes):
  // { status, headers, body }, the headers those a replay repeats, as the
  // redact option changes them (the live response is left as it is).
  // Throws a RedactError when redact throws or returns no such object.
  function toStore(res, body) {
    const stored = { status: res.statusCode, headers: headersToStore(res), body };
    if (!opts.redact) return stored;
    let redacted;
    try {
      redacted = opts.redact(stored);
    } catch (err) {
      throw new RedactError(`the redact option threw: ${err?.message ?? err}`, err);
    }
    const { status, headers, body: kept } = redacted ?? {};
    if (!Number.isInteger(status) || typeof headers !== 'object' || !(Buffer.isBuffer(kept) || typeof kept === 'string'))
      throw new RedactError('the redact option must return { status, headers, body } (body a Buffer or a string)');
    return { status, headers, body: Buffer.from(kept) };
  }

  // Answers 500: the redact option failed, nothing was stored (the writes rolled back, the key is free).
  function redactFailed(res, err) {
    opts.log(`the response was not stored: ${err.message}`);
    return replaceResponse(res, 500, 'idempotency_redact_failed',
      'The response could not be redacted for storing; nothing was kept.');
  }

  // Answers a claim that did not win: replay, in_progress or mismatch.
  function answer(res, claim) {
    switch (claim.outcome) {
      case 'replay':
        res.statusCode = claim.statusCode;
        for (const [name, value] of Object.entries(claim.headers ?? {})) res.setHeader(name, value);
        res.setHeader('Idempotent-Replayed', 'true');
        return res.end(claim.body ?? Buffer.alloc(0));
      case 'in_progress':
        return problem(res, 409, 'idempotency_key_in_progress',
          'A request with this Idempotency-Key is still being processed.',
          { 'Retry-After': String(claim.retryAfter) });
      case 'mismatch':
        return problem(res, 422, 'idempotency_key_mismatch',
          'This Idempotency-Key was used with a different request.');
      default:
        throw new Error(`unexpected claim outcome ${claim.outcome}`);
    }
  }

  // Answers a claim that did not win, asked again or not. One transaction:
  // after a claim whose answer was lost, in_progress is most likely that
  // claim's own transaction, which never commits and holds the key until
  // the server learns its connection is gone (a half-open connection):
  // not a 409 for the request's own claim, but a 503 (nothing was kept).
  function answerClaimedAgain(res, c, claim) {
    if (!(opts.oneTransaction && c.claimLost && claim.outcome === 'in_progress')) return answer(res, claim);
    opts.log('the claim asked again after its answer was lost found the key still held; answering 503');
    return problem(res, 503, 'idempotency_unavailable',
      'The connection to the database was lost while this request was claimed; nothing of it was kept. Retry later.',
      { 'Retry-After': String(claim.retryAfter) });
  }

  // Answers 400: the key is malformed or refused.
  function invalidKey(res) {
    return problem(res, 400, 'idempotency_key_invalid',
      'The Idempotency-Key header must be one string of 1 to 255 printable characters.');
  }

  // Fails closed: without the database, a retry could run twice.
  function unavailable(res, err) {
    opts.log(`database unavailable: ${err.message}`);
    return problem(res, 503, 'idempotency_unavailable',
      'The idempotency store cannot be reached; nothing ran. Retry later.', { 'Retry-After': '1' });
  }

  // Replaces the handler's response with a problem.
  function replaceResponse(res, status, code, detail, headers) {
    return replaceWith(res, () => problem(res, status, code, detail, headers));
  }

  // Sends an RFC 9457 problem (application/problem+json) with its code.
  function problem(res, status, code, detail, headers = {}) {
    const body = JSON.stringify({
      type: opts.problemTypes[code] ?? 'about:blank', title: TITLES[status], status, detail, code,
    });
    res.statusCode = status;
    res.statusMessage = TITLES[status]; // RFC 9110's phrase: 422 is Unprocessable Content
    for (const [name, value] of Object.entries(headers)) res.setHeader(name, value);
    res.setHeader('Content-Type', 'application/problem+json');
    res.setHeader('Content-Length', Buffer.byteLength(body));
    res.end(body);
  }

  return {
    problem, replaceWith, replaceResponse, answer, answerClaimedAgain, invalidKey, unavailable, claimLost,
    toStore, redactFailed,
  };
}

module.exports = { httpAnswers, RedactError };
