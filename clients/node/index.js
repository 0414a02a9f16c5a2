'use strict';
// pg-idempotency: Idempotency-Key for Node.js on the idempotency PostgreSQL extension.

const { idempotency, credentialScope } = require('./lib/express');
const { IdempotencyClient, ClaimLostError } = require('./lib/client');
const { fingerprint } = require('./lib/fingerprint');
const { parseIdempotencyKey } = require('./lib/key');
const { standardWebhook, bodyKey } = require('./lib/webhooks');
const {
  idempotent, IdempotencyInProgressError, IdempotencyMismatchError, IdempotencyStoredError,
} = require('./lib/function');

module.exports = {
  idempotency, credentialScope, IdempotencyClient, ClaimLostError, fingerprint, parseIdempotencyKey,
  standardWebhook, bodyKey,
  idempotent, IdempotencyInProgressError, IdempotencyMismatchError, IdempotencyStoredError,
};
