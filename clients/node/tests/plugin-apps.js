'use strict';
// Small apps on node-idempotency's Express and Fastify plugins with
// PostgresStorageAdapter, for node-idempotency.test.js. Run as a program
// (node plugin-apps.js SCOPE LEASE_MS) it serves the Express app on
// 127.0.0.1 and prints its port: a child process, to see what the plugin's
// unawaited onResponse does to a process.

const { sleep } = require('./helpers');

const TABLE = 'pg_idempotency_test_plugin_charges';

// Returns the plugin module, or null when it is not installed (not every registry serves it).
function optional(name) {
  try {
    require.resolve(name);
  } catch {
    return null;
  }
  return require(name);
}

// Creates the table the handlers write to.
async function createTable(pool) {
  await pool.query(`CREATE TABLE IF NOT EXISTS ${TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tag text)`);
}

// Returns the work of POST /charges, (body, headers) => { charge, tag }:
// sleeps X-Delay-Ms milliseconds (a header, so that the body, the library's
// fingerprint, stays the same), inserts a charge for body.tag, then throws
// when body.fail.
function chargeHandler(pool) {
  return async (body, headers) => {
    const delayMs = Number(headers['x-delay-ms'] ?? 0);
    if (delayMs) await sleep(delayMs);
    const { rows } = await pool.query(`INSERT INTO ${TABLE} (tag) VALUES ($1) RETURNING id`, [body.tag]);
    if (body.fail) throw new Error('the handler failed');
    return { charge: Number(rows[0].id), tag: body.tag };
  };
}

// Returns an Express app with @node-idempotency/express and adapter in front of POST /charges.
async function expressApp(plugin, adapter, pool) {
  const express = require('express');
  const charge = chargeHandler(pool);
  const app = express();
  app.use(express.json());
  app.use(await plugin.idempotencyAsMiddleware({ storage: { adapter }, enforceIdempotency: true }));
  app.post('/charges', async (req, res) => {
    res.status(201).json(await charge(req.body, req.headers));
  });
  // Answers an error as JSON: the plugin's refusals keep the status it set, others are 500.
  app.use((err, req, res, next) => {
    if (res.headersSent) return next(err);
    return res.status(res.statusCode >= 400 ? res.statusCode : 500).json({ code: err.code, message: err.message });
  });
  return app;
}

// Returns a Fastify app with @node-idempotency/fastify and adapter in front of POST /charges.
async function fastifyApp(plugin, adapter, pool) {
  const fastify = require('fastify');
  const fp = require('fastify-plugin');
  const charge = chargeHandler(pool);
  const app = fastify();
  await app.register(fp(plugin.idempotencyAsPlugin), { storage: { adapter }, enforceIdempotency: true });
  app.post('/charges', async (req, reply) => {
    const answer = await charge(req.body, req.headers);
    reply.status(201);
    return answer;
  });
  return app;
}

// Serves the Express app for the scope and lease of argv; prints the port.
async function main() {
  const { Pool } = require('pg');
  const { PostgresStorageAdapter } = require('pg-idempotency/node-idempotency');
  const [scope, leaseMs] = process.argv.slice(2);
  const pool = new Pool({ connectionString: process.env.DATABASE_URL });
  const adapter = new PostgresStorageAdapter({ pool, scope, leaseMs: Number(leaseMs) });
  const app = await expressApp(optional('@node-idempotency/express'), adapter, pool);
  const server = app.listen(0, '127.0.0.1', () => console.log(server.address().port));
}

if (require.main === module) main();

module.exports = { TABLE, optional, createTable, expressApp, fastifyApp };
