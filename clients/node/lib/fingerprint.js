'use strict';
// The request fingerprint, computed in Node exactly as the extension's
// idempotency.fingerprint(method, path, body, query) does (fingerprint.c):
// SHA-256 over four parts, each a presence byte, an 8-byte big-endian length
// and the bytes; the method upper-cased (ASCII only); a null body or query is
// absent, which differs from an empty one.

const crypto = require('node:crypto');

// Returns the 9-byte header of one part: present or not, and its length.
function partHeader(length, present) {
  const header = Buffer.alloc(9);
  header[0] = present ? 1 : 0;
  header.writeBigUInt64BE(BigInt(present ? length : 0), 1);
  return header;
}

// Returns the bytes of a part given as a string (UTF-8) or a Buffer/Uint8Array.
function partBytes(value, name) {
  if (typeof value === 'string') return Buffer.from(value, 'utf8');
  if (value instanceof Uint8Array) return value;
  throw new TypeError(`fingerprint: ${name} must be a string or a Buffer`);
}

// Upper-cases ASCII letters only, as PostgreSQL's asc_toupper does.
function asciiUpper(text) {
  return text.replace(/[a-z]+/g, (s) => s.toUpperCase());
}

// Returns the 32-byte SHA-256 fingerprint of a request; body and query may be null.
function fingerprint(method, path, body = null, query = null) {
  if (method === null || method === undefined) throw new TypeError('fingerprint: method is required');
  if (path === null || path === undefined) throw new TypeError('fingerprint: path is required');
  const hash = crypto.createHash('sha256');
  const parts = [
    partBytes(asciiUpper(String(method)), 'method'),
    partBytes(path, 'path'),
    body === null || body === undefined ? null : partBytes(body, 'body'),
    query === null || query === undefined ? null : partBytes(query, 'query'),
  ];
  for (const part of parts) {
    hash.update(partHeader(part ? part.length : 0, part !== null));
    if (part && part.length > 0) hash.update(part);
  }
  return hash.digest();
}

module.exports = { fingerprint };
