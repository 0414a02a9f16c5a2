'use strict';
// One Express 5 app per variant, the same handler in each: one INSERT
// through a node-postgres pool of 10, answering 201 {"charge": id}.
//
//   VARIANT=plain|ours-two|ours-one|ours-one-text|express-idempotency|node-idempotency|hand-written
//   DATABASE_URL=... REDIS_URL=redis://127.0.0.1:PORT PORT=... node app.js
//
// PGOPTIONS_EXTRA: startup options of the pool's connections (e.g.
// '-c synchronous_commit=off'). OURS_CACHE=off turns our replay cache off;
// OURS_PREPARE=off sends our claim and complete as plain text, as through
// a transaction pooler (default: the prepare option, for a direct
// connection); ours-one-text is ours-one so, beside it in the same run.
// hand-written is no library: the recipe a careful team writes by hand
// (clients/node/bench/recipe.js), on a table of its own it creates.

const express = require('express');
const { Pool } = require('pg');

const variant = process.env.VARIANT;
const pool = new Pool({
  connectionString: process.env.DATABASE_URL, max: 10,
  ...(process.env.PGOPTIONS_EXTRA ? { options: process.env.PGOPTIONS_EXTRA } : {}),
});
pool.on('error', (err) => console.error('idle connection lost:', err.message));
const INSERT = 'INSERT INTO charges (amount) VALUES ($1) RETURNING id';

// The handler: db is req.db for ours (the request's transaction), the pool for the others.
async function charge(db, req, res) {
  const { rows } = await db.query(INSERT, [req.body.amount]);
  res.status(201).json({ charge: Number(rows[0].id) });
}

// Returns the app of this variant.
async function makeApp() {
  const app = express();
  app.disable('x-powered-by');
  app.get('/', (req, res) => res.json({ status: 'ok' }));
  switch (variant) {
    case 'plain':
      app.post('/payments', express.json(), (req, res) => charge(pool, req, res));
      break;
    case 'ours-two':
    case 'ours-one':
    case 'ours-one-text': {
      const { idempotency } = require('pg-idempotency');
      app.post('/payments', idempotency(pool, {
        oneTransaction: variant !== 'ours-two', cache: process.env.OURS_CACHE !== 'off',
        prepare: process.env.OURS_PREPARE !== 'off' && variant !== 'ours-one-text',
      }), (req, res) => charge(req.db, req, res));
      break;
    }
    case 'express-idempotency': {
      const { idempotency, getSharedIdempotencyService } = require('express-idempotency');
      const RedisAdapter = require('express-idempotency-redis-adapter').default;
      const dataAdapter = new RedisAdapter({ connectionConfig: { url: process.env.REDIS_URL } });
      await dataAdapter.connect();
      app.post('/payments', express.json(), idempotency({ dataAdapter }), (req, res) => {
        if (getSharedIdempotencyService().isHit(req)) return undefined; // the middleware answered
        return charge(pool, req, res);
      });
      break;
    }
    case 'node-idempotency': {
      const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = require('@node-idempotency/core');
      const { RedisStorageAdapter } = require('@node-idempotency/storage-adapter-redis');
      const storage = new RedisStorageAdapter({ url: process.env.REDIS_URL });
      await storage.connect();
      const idem = new Idempotency(storage, { enforceIdempotency: true });
      app.post('/payments', express.json(), nodeIdempotency(idem, IdempotencyError, IdempotencyErrorCodes),
        (req, res) => charge(pool, req, res));
      break;
    }
    case 'hand-written': {
      const recipe = require('../../clients/node/bench/recipe');
      await pool.query(recipe.TABLE);
      app.post('/payments', express.json({ verify: recipe.keepRawBody }), recipe.handWritten(pool, async (db, req) => {
        const { rows } = await db.query(INSERT, [req.body.amount]);
        return { status: 201, body: Buffer.from(JSON.stringify({ charge: Number(rows[0].id) })) };
      }));
      break;
    }
    default:
      throw new Error(`unknown VARIANT ${variant}`);
  }
  return app;
}

// Express glue for @node-idempotency/core, as its Express plugin does it:
// onRequest before the handler (a stored response is sent as is), onResponse
// with the handler's answer as it is sent, not awaited.
function nodeIdempotency(idem, IdempotencyError, codes) {
  const STATUS = {
    [codes.REQUEST_IN_PROGRESS]: 409, [codes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
    [codes.IDEMPOTENCY_KEY_MISSING]: 400, [codes.IDEMPOTENCY_KEY_LEN_EXEEDED]: 400,
  };
  return async (req, res, next) => {
    const request = { headers: req.headers, body: req.body, path: req.path, method: req.method };
    let stored;
    try {
      stored = await idem.onRequest(request);
    } catch (err) {
      if (err instanceof IdempotencyError) return res.status(STATUS[err.code] ?? 400).json({ error: err.code });
      return next(err);
    }
    if (stored) return res.status(stored.additional?.statusCode ?? 200).send(stored.body);
    const send = res.send.bind(res);
    res.send = (body) => {
      idem.onResponse(request, { body, additional: { statusCode: res.statusCode } }).catch(() => {});
      return send(body);
    };
    return next();
  };
}

makeApp().then((app) => {
  const server = app.listen(Number(process.env.PORT), '127.0.0.1', () => console.log(`${variant} listening`));
  process.once('SIGTERM', () => server.close(() => pool.end().then(() => process.exit(0))));
}).catch((err) => {
  console.error(err);
  process.exit(1);
});
