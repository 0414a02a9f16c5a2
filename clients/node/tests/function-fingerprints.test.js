'use strict';
// The shared vectors of clients/testdata/function-fingerprints.json: an
// idempotent function's fingerprint of each vector's arguments is the one
// every client makes of them.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');

const installed = path.dirname(require.resolve('pg-idempotency/package.json'));
const { argumentsFingerprint, canonicalJson } = require(path.join(installed, 'lib', 'function.js'));
const { vectors } = JSON.parse(fs.readFileSync(process.env.FUNCTION_FINGERPRINTS, 'utf8'));

for (const vector of vectors) {
  test(`function fingerprint: ${vector.name}`, () => {
    const args = JSON.parse(vector.arguments);
    assert.equal(canonicalJson(args), vector.canonical);
    assert.equal(argumentsFingerprint(args).toString('hex'), vector.sha256);
  });
}
