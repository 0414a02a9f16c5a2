'use strict';
// Webhook receivers: the middleware's options that take the key from where
// senders put it. Standard Webhooks (https://www.standardwebhooks.com): the
// request is verified (signature and timestamp, by the sender's library)
// before anything is claimed, the key is the webhook-id header and the scope
// "webhook:" and the sender. Senders that keep their event id in the body (Stripe's "id"):
// bodyKey.

const { headerField } = require('./key');

// Returns the middleware options of a Standard Webhooks receiver. webhook:
// what verifies a delivery, e.g. new Webhook(secret) of the npm package
// standardwebhooks (anything with verify(payload, headers) that throws on a
// bad signature or a timestamp outside its tolerance); sender: who sends its
// events (default 'standard-webhooks'), whose scope is "webhook:" and the sender.
function standardWebhook(webhook, { sender = 'standard-webhooks' } = {}) {
  if (!webhook || typeof webhook.verify !== 'function')
    throw new TypeError('standardWebhook() needs a verifier, e.g. new Webhook(secret) of the package standardwebhooks');
  if (typeof sender !== 'string') throw new TypeError('standardWebhook(): sender must be a string');
  return {
    methods: ['POST'],
    verify: (req) => { webhook.verify(req.rawBody, req.headers); },
    key: (req) => headerField(req, 'webhook-id'),
    scope: () => `webhook:${sender}`,
  };
}

// Returns a key option reading a string field of the parsed JSON body (by
// default "id", where Stripe keeps the event id): undefined when the body
// has no such field, null when it is not a string.
function bodyKey(field = 'id') {
  return (req) => {
    const body = req.body;
    if (body === null || typeof body !== 'object' || Buffer.isBuffer(body) || !(field in body)) return undefined;
    return typeof body[field] === 'string' ? body[field] : null;
  };
}

module.exports = { standardWebhook, bodyKey };
