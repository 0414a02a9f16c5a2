'use strict';
// The Idempotency-Key field: a Structured Field String, or the same key bare.

const test = require('node:test');
const assert = require('node:assert/strict');
const { parseIdempotencyKey } = require('pg-idempotency');

test('a Structured Field String is unescaped; spaces and tabs around it are allowed', () => {
  assert.equal(parseIdempotencyKey('"order-42"'), 'order-42');
  assert.equal(parseIdempotencyKey(' \t"order 42" '), 'order 42');
  assert.equal(parseIdempotencyKey('"say \\"hi\\" \\\\ bye"'), 'say "hi" \\ bye');
  assert.equal(parseIdempotencyKey(`"${'k'.repeat(255)}"`), 'k'.repeat(255));
});

test('a bare key of token characters, colons and slashes is the same key', () => {
  for (const key of ['order-42', '8e03978e-40d5-43e8-bc93-6894a57f9324', '42', '4.5', 'a:b/c', "!#$%&'*+-.^_`|~"])
    assert.equal(parseIdempotencyKey(key), key);
});

test('anything else is refused', () => {
  const bad = ['', '""', '"unterminated', '"abc";x=1', '"abc" x', '?1', ':YWJj:', '(a b)', '"a\\qb"',
    '"a", "b"', 'a b', 'a,b', '"tab\there"', '"é"', 'é', `"${'k'.repeat(256)}"`, 'k'.repeat(256)];
  for (const value of bad) assert.equal(parseIdempotencyKey(value), null, JSON.stringify(value));
  assert.equal(parseIdempotencyKey(undefined), null);
});
