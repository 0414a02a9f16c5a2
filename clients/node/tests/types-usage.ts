// Compiled (not run) by types.test.js: the package's types as users write against them.
import express from 'express';
import { Pool } from 'pg';
import { Idempotency } from '@node-idempotency/core';
import { makeIdempotent, IdempotencyConfig } from '@aws-lambda-powertools/idempotency';
import {
  idempotency, IdempotencyClient, ClaimLostError, fingerprint, parseIdempotencyKey, type Claim,
  standardWebhook, bodyKey, idempotent, IdempotencyInProgressError, IdempotencyStoredError, type Run,
} from 'pg-idempotency';
import { Webhook } from 'standardwebhooks';
import { PostgresPersistenceLayer } from 'pg-idempotency/powertools';
import { PostgresStorageAdapter } from 'pg-idempotency/node-idempotency';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
import { trace } from '@opentelemetry/api';

const pool = new Pool();
const app = express();
app.use(idempotency(pool, { lease: '30 seconds', failOpen: false, storeHeaders: ['content-type'] }));
app.post('/payments', async (req, res) => {
  const { rows } = await req.db!.query('INSERT INTO charges (amount) VALUES ($1) RETURNING id', [10]);
  res.status(201).json({ charge: rows[0].id, bytes: req.rawBody?.length });
});

async function direct(): Promise<string | undefined> {
  const idem = new IdempotencyClient(pool, { scope: 'acct_42', lease: 60_000 });
  const claim: Claim = await idem.claim('order-42', fingerprint('POST', '/payments', '{"amount":10}'));
  if (claim.outcome !== 'new' || claim.fence === null) return claim.outcome;
  const leaseEnd: Date = await idem.extend('order-42', claim.fence, { lease: '2 minutes' });
  await idem.checkpoint('order-42', claim.fence, 'charged', { at: leaseEnd.toISOString() });
  const record = await idem.lookup('order-42');
  if (record?.state === 'completed') return String(record.statusCode);
  if (await idem.release('other', claim.fence, { scope: 'acct_43' })) return 'released';
  try {
    return await idem.complete('order-42', claim.fence, 201, '{"charge":1}', { 'content-type': 'application/json' });
  } catch (err) {
    if (err instanceof ClaimLostError) return err.code;
    throw err;
  }
}

const persistenceStore = new PostgresPersistenceLayer({ pool, scope: 'payments' });
const handler = makeIdempotent(async (event: { id: string }) => event.id, {
  persistenceStore, config: new IdempotencyConfig({ eventKeyJmesPath: 'id' }),
});
const library = new Idempotency(new PostgresStorageAdapter({ pool, leaseMs: 30_000 }));
const tracerProvider = new BasicTracerProvider();
app.use(idempotency(pool, { oneTransaction: true, prepare: true, tracerProvider }));
app.post('/webhooks', idempotency(pool, { ...standardWebhook(new Webhook('whsec_c2VjcmV0'), { sender: 'acme' }), lease: 10_000 }));
app.post('/redacted', idempotency(pool, { redact: ({ status, headers }) => ({ status, headers, body: '{"card":"redacted"}' }) }));
app.post('/stripe', idempotency(pool, { key: bodyKey('id'), scope: () => 'stripe', verify: (req) => { if (req.rawBody.length === 0) throw new Error('empty'); } }));
const chargeOnce = idempotent(pool, async (run: Run, order: { id: string; amount: number }) => {
  await run.checkpoint('started', { at: run.attempt });
  const { rows } = await run.db.query('INSERT INTO charges (amount) VALUES ($1) RETURNING id', [order.amount]);
  return { charge: Number(rows[0].id) };
}, { key: (order) => `order:${order.id}`, scope: 'payments', oneTransaction: false, lease: '2 minutes' });
async function useChargeOnce(): Promise<number | string> {
  try {
    return (await chargeOnce({ id: '42', amount: 10 })).charge;
  } catch (err) {
    if (err instanceof IdempotencyInProgressError) return err.retryAfter;
    if (err instanceof IdempotencyStoredError) return err.error.message;
    throw err;
  }
}
const traced = new IdempotencyClient(pool, { tracerProvider: trace.getTracerProvider() });
const tracedStore = new PostgresPersistenceLayer({ pool, tracerProvider });

export { app, direct, useChargeOnce, handler, library, parseIdempotencyKey, traced, tracedStore };
