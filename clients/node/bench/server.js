'use strict';
// The retried-payment route under one of six set-ups, for bench/overhead.js:
//   middleware   pg-idempotency's middleware (req.db is its transaction)
//   middleware-one  the same in one-transaction mode
//   middleware-one-prepared  the same with the prepare option (a direct connection: the best mode)
//   recipe       the hand-written recipe, no idempotency library (recipe.js)
//   transaction  no idempotency; a transaction per request (BEGIN ... COMMIT), as the middleware gives
//   plain        no idempotency, no transaction: the insert alone
// Counts the statements sent to the database (GET /stats).

const express = require('express');
const { Pool } = require('pg');
const { idempotency } = require('pg-idempotency');
const recipe = require('./recipe');

const mode = process.argv[2];
const pool = new Pool({ connectionString: process.env.DATABASE_URL, max: 4 });
let statements = 0;
pool.on('connect', (client) => {
  const query = client.query.bind(client);
  client.query = (...args) => { statements++; return query(...args); };
});

// Gives the handler a transaction as req.db, committed after the response is sent.
function transaction(req, res, next) {
  express.json()(req, res, async (err) => {
    if (err) return next(err);
    const db = await pool.connect();
    await db.query('BEGIN');
    req.db = db;
    const { end } = res;
    res.end = (...args) => {
      res.end = end;
      db.query('COMMIT').then(() => { db.release(); res.end(...args); }, next);
      return res;
    };
    next();
  });
}

const app = express();
app.get('/stats', (req, res) => res.json({ statements }));
// Inserts the request's charge through db; resolves to the 201 answer.
async function charge(db, req) {
  const { rows } = await db.query('INSERT INTO bench_charges (amount) VALUES ($1) RETURNING id', [req.body.amount]);
  return { status: 201, body: Buffer.from(JSON.stringify({ charge: Number(rows[0].id) })) };
}

if (mode === 'recipe') {
  app.post('/payments', express.json({ verify: recipe.keepRawBody }), recipe.handWritten(pool, charge));
} else {
  if (mode === 'middleware') app.use(idempotency(pool));
  else if (mode === 'middleware-one') app.use(idempotency(pool, { oneTransaction: true }));
  else if (mode === 'middleware-one-prepared') app.use(idempotency(pool, { oneTransaction: true, prepare: true }));
  else if (mode === 'transaction') app.use(transaction);
  else app.use(express.json(), (req, res, next) => { req.db = pool; next(); });
  app.post('/payments', async (req, res) => {
    const { status, body } = await charge(req.db, req);
    res.status(status).type('json').send(body);
  });
}

pool.query('CREATE TABLE IF NOT EXISTS bench_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, amount numeric NOT NULL)')
  .then(() => pool.query(recipe.TABLE))
  .then(() => {
    const server = app.listen(0, '127.0.0.1', () => process.send(server.address().port));
  });
