'use strict';
// Webhook receivers: Standard Webhooks (verified before any claim; key =
// webhook-id, scope = "webhook:" and the sender) and a key read from the body (Stripe's id).

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { Webhook } = require('standardwebhooks');
const { idempotency, standardWebhook, bodyKey, IdempotencyClient } = require('pg-idempotency');
const { newPool, unique, listen, send } = require('./helpers');

const pool = newPool();
const idem = new IdempotencyClient(pool);
const SECRET = `whsec_${Buffer.from('the secret of webhooks.test.js').toString('base64')}`;
const sender = new Webhook(SECRET);
let runs = 0;
let server;

test.before(async () => {
  const app = express();
  app.post('/standard', idempotency(pool, standardWebhook(new Webhook(SECRET), { sender: 'acme' })), (req, res) => {
    runs += 1;
    res.status(200).json({ received: req.body.type, run: runs });
  });
  app.post('/stripe', idempotency(pool, { key: bodyKey('id'), scope: () => 'webhook:stripe' }), (req, res) => {
    runs += 1;
    res.status(200).json({ received: req.body.id, run: runs });
  });
  server = await listen(app);
});
test.after(async () => {
  await server.close();
  await pool.end();
});

// Delivers body to path signed by webhook (default the receiver's secret) as message id at seconds.
function deliver(id, body, { webhook = sender, seconds = Math.floor(Date.now() / 1000), path = '/standard' } = {}) {
  const text = JSON.stringify(body);
  return send(server.url, {
    path, body: text, headers: [['Content-Type', 'application/json'], ['webhook-id', id],
      ['webhook-timestamp', String(seconds)], ['webhook-signature', webhook.sign(id, new Date(seconds * 1000), text)]],
  });
}

test('a Standard Webhooks delivery runs once: key = webhook-id, scope = webhook:<sender>; a redelivery replays', async () => {
  const id = unique('msg');
  const first = await deliver(id, { type: 'a' });
  assert.equal(first.status, 200);
  const again = await deliver(id, { type: 'a' }, { seconds: Math.floor(Date.now() / 1000) + 1 });
  assert.equal(again.status, 200);
  assert.equal(again.headers['idempotent-replayed'], 'true');
  assert.deepEqual(again.body, first.body);
  const record = await idem.lookup(id, { scope: 'webhook:acme' });
  assert.equal(record.state, 'completed');
  assert.equal((await deliver(id, { type: 'b' })).status, 422);
});

test('an unverified delivery is 401 and never claimed: bad signature, old timestamp, no headers', async () => {
  const before = runs;
  const forged = unique('msg');
  const other = new Webhook(`whsec_${Buffer.from('another secret').toString('base64')}`);
  const bad = await deliver(forged, { type: 'x' }, { webhook: other });
  assert.equal(bad.status, 401);
  assert.equal(bad.json().code, 'webhook_unverified');
  const old = unique('msg');
  assert.equal((await deliver(old, { type: 'x' }, { seconds: Math.floor(Date.now() / 1000) - 600 })).status, 401);
  const bare = unique('msg');
  const unsigned = await send(server.url, { path: '/standard', body: '{}',
    headers: [['Content-Type', 'application/json'], ['webhook-id', bare]] });
  assert.equal(unsigned.status, 401);
  assert.equal(runs, before);
  for (const key of [forged, old, bare]) assert.equal(await idem.lookup(key, { scope: 'webhook:acme' }), null);
});

test('a key read from the body (Stripe\'s id): one run per event id; none in the body: 400', async () => {
  const id = unique('evt');
  const first = await send(server.url, { path: '/stripe', body: JSON.stringify({ id, type: 'charge.succeeded' }),
    headers: [['Content-Type', 'application/json']] });
  const again = await send(server.url, { path: '/stripe', body: JSON.stringify({ id, type: 'charge.succeeded' }),
    headers: [['Content-Type', 'application/json']] });
  assert.equal(first.status, 200);
  assert.equal(again.headers['idempotent-replayed'], 'true');
  assert.deepEqual(again.body, first.body);
  assert.equal((await idem.lookup(id, { scope: 'webhook:stripe' })).state, 'completed');
  const none = await send(server.url, { path: '/stripe', body: '{"type":"x"}', headers: [['Content-Type', 'application/json']] });
  assert.equal(none.status, 400);
  const notText = await send(server.url, { path: '/stripe', body: '{"id":42}', headers: [['Content-Type', 'application/json']] });
  assert.equal(notText.status, 400);
});
