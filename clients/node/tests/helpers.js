'use strict';
// Shared by the tests: pools on DATABASE_URL, unique names, an HTTP client
// that sends headers exactly as given (repeated fields included).

const crypto = require('node:crypto');
const http = require('node:http');
const { Pool } = require('pg');

if (!process.env.DATABASE_URL) throw new Error('DATABASE_URL must name a database with the idempotency extension');

// Returns a pg.Pool on the test database, as user when given; options: the
// connection's startup options (e.g. '-c name=value').
function newPool({ user, options } = {}) {
  const url = new URL(process.env.DATABASE_URL);
  if (user) url.username = user;
  return new Pool({ connectionString: url.href, ...(options ? { options } : {}) });
}

// Returns a name no other test uses.
function unique(prefix) {
  return `${prefix}-${crypto.randomUUID()}`;
}

// Waits ms milliseconds.
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// Starts an HTTP server for app on 127.0.0.1; resolves to { url, close() }.
function listen(app) {
  return new Promise((resolve) => {
    const server = http.createServer(app).listen(0, '127.0.0.1', () => {
      resolve({
        url: `http://127.0.0.1:${server.address().port}`,
        close: () => new Promise((done) => server.close(done)),
      });
    });
  });
}

// Sends a request; headers is a list of [name, value] (a name may repeat).
// Resolves to { status, headers, body (Buffer), json() }.
function send(url, { method = 'POST', path = '/', headers = [], body = null } = {}) {
  return new Promise((resolve, reject) => {
    const flat = ['Host', new URL(url).host, ...headers.flat()]; // a header list gets no Host of its own
    if (body !== null) flat.push('Content-Length', String(Buffer.byteLength(body)));
    const req = http.request(`${url}${path}`, { method, headers: flat }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const raw = Buffer.concat(chunks);
        resolve({ status: res.statusCode, headers: res.headers, body: raw, json: () => JSON.parse(raw.toString()) });
      });
    });
    req.on('error', reject);
    req.end(body ?? undefined);
  });
}

// Returns the scope the middleware derives from an Authorization header value.
function scopeOf(authorization) {
  return crypto.createHash('sha256').update(`authorization:${authorization}`).digest('hex');
}

module.exports = { newPool, unique, sleep, listen, send, scopeOf };
