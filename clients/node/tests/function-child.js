'use strict';
// Run by function.test.js as a process of its own, which the test kills:
// calls an idempotent function (mode: "one" or "two" transactions) on key
// that writes a row tagged key, records a checkpoint, says "running" and
// never returns.
const { idempotent } = require('pg-idempotency');
const { newPool } = require('./helpers');

const [mode, key, table] = process.argv.slice(2);
const pool = newPool();
const charge = idempotent(pool, async (run, order) => {
  await run.db.query(`INSERT INTO ${table} (tag) VALUES ($1)`, [order.tag]);
  await run.checkpoint('charged', { provider: 'ch_1' });
  process.stdout.write('running\n');
  await new Promise(() => {}); // the test kills the process here
}, { key: (order) => order.tag, oneTransaction: mode === 'one', lease: '1 second' });
charge({ tag: key, amount: 5 }).catch((err) => {
  console.error(err);
  process.exit(1);
});
