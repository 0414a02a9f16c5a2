'use strict';
// The request fingerprint, computed in Node exactly as the extension's
// idempotency.fingerprint(method, path, body, query) does (fingerprint.c):
// SHA-256 over four parts, each a presence byte, an 8-byte big-endian length
// and the bytes; the method upper-cased (ASCII only); a null body or query is
// absent, which differs from an empty one.

const crypto = require('node:crypto');

// Returns the SHA-256 of bytes in encoding ('buffer': a Buffer, 'hex'): in
// one call where Node has crypto.hash (20.12 and later), which spares the
// Hash object of every request.
const sha256 = typeof crypto.hash === 'function'
  ? (bytes, encoding) => crypto.hash('sha256', bytes, encoding)
  : (bytes, encoding) => crypto.createHash('sha256').update(bytes).digest(encoding === 'buffer' ? undefined : encoding);

// Returns the bytes of a part given as a string (UTF-8) or a Buffer/Uint8Array.
function partBytes(value, name) {
  if (typeof value === 'string') return Buffer.from(value, 'utf8');
  if (value instanceof Uint8Array) return value;
  throw new TypeError(`fingerprint: ${name} must be a string or a Buffer`);
}

// Upper-cases ASCII letters only, as PostgreSQL's asc_toupper does.
function asciiUpper(text) {
  return /[a-z]/.test(text) ? text.replace(/[a-z]+/g, (s) => s.toUpperCase()) : text;
}

// Returns the 32-byte SHA-256 fingerprint of a request; body and query may be null.
// The four parts are laid out in one buffer and hashed at once.
function fingerprint(method, path, body = null, query = null) {
  if (method === null || method === undefined) throw new TypeError('fingerprint: method is required');
  if (path === null || path === undefined) throw new TypeError('fingerprint: path is required');
  const parts = [
    partBytes(asciiUpper(String(method)), 'method'),
    partBytes(path, 'path'),
    body === null || body === undefined ? null : partBytes(body, 'body'),
    query === null || query === undefined ? null : partBytes(query, 'query'),
  ];
  let size = 0;
  for (const part of parts) size += 9 + (part ? part.length : 0);
  const all = Buffer.alloc(size);
  let at = 0;
  for (const part of parts) {
    all[at] = part ? 1 : 0;
    all.writeBigUInt64BE(BigInt(part ? part.length : 0), at + 1);
    at += 9;
    if (part) {
      all.set(part, at);
      at += part.length;
    }
  }
  return sha256(all, 'buffer');
}

module.exports = { fingerprint, sha256 };
