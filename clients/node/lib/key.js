'use strict';
// The Idempotency-Key field (docs/http-contract.md): a Structured Field
// String (RFC 8941), or the same key sent bare when it is made only of token
// characters (RFC 9110 tchar, plus ':' and '/') and does not start with ':'.

const MAX_KEY_BYTES = 255;
const BARE_KEY = /^[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+$/;

// Returns the content of a Structured Field String, or null when malformed.
function parseSfString(text) {
  if (text[0] !== '"') return null;
  let key = '';
  for (let i = 1; i < text.length; i++) {
    const c = text[i];
    const code = c.charCodeAt(0);
    if (code < 0x20 || code > 0x7e) return null;
    if (c === '\\') {
      const next = text[++i];
      if (next !== '"' && next !== '\\') return null;
      key += next;
    } else if (c === '"') {
      return i === text.length - 1 ? key : null; // nothing may follow the string
    } else {
      key += c;
    }
  }
  return null; // unterminated
}

// Parses the field's value: returns the key, or null when it is not a valid key.
function parseIdempotencyKey(value) {
  if (typeof value !== 'string') return null;
  const text = value.replace(/^[ \t]+|[ \t]+$/g, '');
  let key;
  if (text.startsWith('"')) key = parseSfString(text);
  else key = BARE_KEY.test(text) && text[0] !== ':' ? text : null;
  if (key === null || key.length === 0 || Buffer.byteLength(key) > MAX_KEY_BYTES) return null;
  return key;
}

// Returns header field name (lowercase) of req as sent: undefined when
// absent, null when sent more than once.
function headerField(req, name) {
  const values = [];
  for (let i = 0; i < req.rawHeaders.length; i += 2)
    if (req.rawHeaders[i].toLowerCase() === name) values.push(req.rawHeaders[i + 1]);
  if (values.length > 1) return null;
  return values[0];
}

// Returns the key of a request from its Idempotency-Key field: undefined
// when absent, null when malformed or sent more than once.
function idempotencyKeyOf(req) {
  const field = headerField(req, 'idempotency-key');
  return field === undefined ? undefined : parseIdempotencyKey(field);
}

module.exports = { parseIdempotencyKey, headerField, idempotencyKeyOf, MAX_KEY_BYTES };
