'use strict';
// The retried-payment API: POST /payments charges once per Idempotency-Key.
//
// Environment: DATABASE_URL (a database with CREATE EXTENSION idempotency
// done), PORT (default 3000), HOST (default 127.0.0.1); for the tests,
// IDEMPOTENCY_LEASE (unset: the database's idempotency.lease), IDEMPOTENCY_FAIL_OPEN=on and
// IDEMPOTENCY_ONE_TRANSACTION=on (the claim in the handler's transaction:
// this handler's effects are all in this database).

const express = require('express');
const { Pool } = require('pg');
const { idempotency, standardWebhook } = require('pg-idempotency');
const { Webhook } = require('standardwebhooks');

const pool = new Pool({
  connectionString: process.env.DATABASE_URL,
  connectionTimeoutMillis: 5000, // an unreachable database answers 503, not a hang
});
// An idle connection that the server closed must not crash the process.
pool.on('error', (err) => console.error('idle connection lost:', err.message));

const app = express();
app.disable('x-powered-by');

// Health: answers without touching the database.
app.get('/', (req, res) => res.json({ status: 'ok' }));

// WEBHOOK_SECRET (whsec_...): serve POST /webhooks.
if (process.env.WEBHOOK_SECRET) app.use(webhookReceiver(process.env.WEBHOOK_SECRET));

// After authentication, before the routes it guards. With authentication,
// pass the principal as the scope (scope: (req) => `account:${req.user.id}`):
// a retry after a token refresh then still meets its first request. This
// app has none, so the scope is the default, a hash of Authorization.
app.use(idempotency(pool, {
  lease: process.env.IDEMPOTENCY_LEASE || null, // null: the database's idempotency.lease
  failOpen: process.env.IDEMPOTENCY_FAIL_OPEN === 'on',
  oneTransaction: process.env.IDEMPOTENCY_ONE_TRANSACTION === 'on',
}));

// Charges the amount. Test knobs: delay_ms sleeps first, fail answers 500
// after the charge was written (the middleware rolls it back).
app.post('/payments', async (req, res) => {
  const { amount, delay_ms: delayMs = 0, fail = false } = req.body ?? {};
  if (typeof amount !== 'number' || !(amount > 0))
    return res.status(400).json({ error: 'amount must be a positive number' });
  const charge = await chargeOnce(req.db, amount, delayMs);
  if (fail) return res.status(500).json({ error: `charge ${charge} was declined` });
  res.status(201).json({ charge });
});

// Writes a charge of amount through db (after delayMs); returns its id.
async function chargeOnce(db, amount, delayMs = 0) {
  if (delayMs > 0) await new Promise((resolve) => setTimeout(resolve, delayMs));
  const { rows } = await db.query('INSERT INTO charges (amount) VALUES ($1) RETURNING id', [amount]);
  return Number(rows[0].id);
}

// Standard Webhooks receiver: the event's data.amount is charged as
// POST /payments charges it. The middleware verifies the signature and
// timestamp before it claims anything (401 otherwise); the key is the
// webhook-id, the scope "webhook:" and the sender: a redelivery gets the
// stored answer.
// Mounted on its route, so the Idempotency-Key middleware below does not see it.
function webhookReceiver(secret) {
  return express.Router().post('/webhooks',
    idempotency(pool, standardWebhook(new Webhook(secret), { sender: 'standard-webhooks' })),
    async (req, res) => {
      const { amount, delay_ms: delayMs = 0 } = req.body?.data ?? {};
      if (typeof amount !== 'number' || !(amount > 0))
        return res.status(400).json({ error: 'data.amount must be a positive number' });
      res.status(200).json({ charge: await chargeOnce(req.db, amount, delayMs) });
    });
}

// Creates the business table when missing, then listens.
async function main() {
  await pool.query(`CREATE TABLE IF NOT EXISTS charges (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      amount numeric NOT NULL,
      created_at timestamptz NOT NULL DEFAULT now())`);
  const port = Number(process.env.PORT ?? 3000);
  const host = process.env.HOST ?? '127.0.0.1';
  const server = app.listen(port, host, () => console.log(`listening on http://${host}:${port}`));
  const stop = () => server.close(() => pool.end());
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
}

main().catch((err) => {
  console.error(err.message);
  process.exit(1);
});
