'use strict';
// The hand-written recipe, with no idempotency library: what a careful team
// writes with node-postgres before it reaches for one, the yardstick of
// bench/overhead.js and bench/peers. In one transaction, INSERT ... ON
// CONFLICT DO NOTHING claims (scope, key) in a table of its own; when it
// inserted, the work and the UPDATE that stores the response; when it did
// not (the key committed before, or a concurrent duplicate waited on the
// unique index until it did), the SELECT of the stored response: replayed
// when the request hash is the same, else 422. Scoped per caller (a hash of
// the credential). Any error rolls the claim back with the work, so that a
// retry runs again; so does a crash.

const crypto = require('node:crypto');

// The recipe's table.
const TABLE = `CREATE TABLE IF NOT EXISTS recipe_keys (
  scope text NOT NULL, key text NOT NULL, request_hash bytea NOT NULL,
  status text NOT NULL DEFAULT 'started', response_code int, response_body bytea,
  created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))`;
const CLAIM = 'INSERT INTO recipe_keys (scope, key, request_hash) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING';
const STORED = 'SELECT request_hash, status, response_code, response_body FROM recipe_keys WHERE scope = $1 AND key = $2';
const STORE = "UPDATE recipe_keys SET status = 'completed', response_code = $3, response_body = $4 " +
  'WHERE scope = $1 AND key = $2';

// Returns the SHA-256 of the parts, one after another.
function sha256(...parts) {
  const hash = crypto.createHash('sha256');
  for (const part of parts) hash.update(part);
  return hash.digest();
}

// The verify option of express.json() that keeps the raw body for the request hash.
function keepRawBody(req, res, raw) {
  req.rawBody = raw;
}

// Returns an Express route (after express.json({ verify: keepRawBody })) that
// runs work(db, req) under the recipe; work resolves to { status, body } (a
// JSON body as a Buffer) and writes through db, the request's transaction.
function handWritten(pool, work) {
  return async (req, res) => {
    const key = req.get('idempotency-key');
    if (!key || key.length > 255) return res.status(400).json({ error: 'Idempotency-Key required' });
    const scope = sha256(req.get('authorization') ?? '').toString('hex');
    const requestHash = sha256(`${req.method} ${req.path}\n`, req.rawBody ?? '');
    const db = await pool.connect();
    try {
      await db.query('BEGIN');
      const claimed = await db.query(CLAIM, [scope, key, requestHash]);
      if (claimed.rowCount === 0) {
        const { rows: [row] } = await db.query(STORED, [scope, key]);
        await db.query('COMMIT');
        if (!row.request_hash.equals(requestHash)) return res.status(422).json({ error: 'key reused' });
        if (row.status !== 'completed') return res.status(409).json({ error: 'in progress' });
        return res.status(row.response_code).set('Idempotent-Replayed', 'true').type('json').send(row.response_body);
      }
      const { status, body } = await work(db, req);
      if (status >= 500) { // not stored: the retry runs again
        await db.query('ROLLBACK');
      } else {
        await db.query(STORE, [scope, key, status, body]);
        await db.query('COMMIT');
      }
      return res.status(status).type('json').send(body);
    } catch (err) {
      await db.query('ROLLBACK').catch(() => {});
      if (!res.headersSent) res.status(500).json({ error: err.message });
      return undefined;
    } finally {
      db.release();
    }
  };
}

module.exports = { TABLE, keepRawBody, handWritten };
