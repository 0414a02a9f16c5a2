'use strict';
// Jobs that run once however often the queue delivers them: a pg-boss queue
// "charges" on the application's database, whose job charges data.amount
// into the same charges table as the example apps' POST /payments. The job
// is an idempotent function of pg-idempotency keyed by the job's id: a job
// delivered again (its worker died after its work committed, before
// pg-boss heard of it) gets the stored result, and nothing is charged again.
//
//   ./run worker            works on the queue until SIGTERM
//   ./run enqueue AMOUNT    sends a job; prints its id
//   ./run status ID         prints the job's state and output (JSON)
//   ./run storm [once|bare] the redelivery storm: jobs per second, effects
//
// Environment: DATABASE_URL; JOBS_EXPIRE_SECONDS (default 60: how long a
// delivery may run before pg-boss delivers the job again); JOBS_ACK=transaction
// (pg-boss's completion commits with the job's work); for the tests,
// JOBS_CRASH=mid-job (the worker kills itself after writing the charge,
// before its transaction commits) or after-commit (after the function
// committed, before pg-boss's acknowledgment).

const { Pool } = require('pg');
const { PgBoss } = require('pg-boss');
const { idempotent } = require('pg-idempotency');

const QUEUE = 'charges';
const pool = new Pool({ connectionString: process.env.DATABASE_URL, connectionTimeoutMillis: 5000 });
pool.on('error', (err) => console.error('idle connection lost:', err.message));

// Returns the job: it charges the job's amount once per job id: its
// writes and its result commit together (one transaction); a delivery of a
// job that already ran gets that result back without running. With
// JOBS_ACK=transaction, pg-boss's completion of the job commits with them
// too (complete() with the function's transaction as its db).
function chargeJob(boss) {
  return idempotent(pool, async (run, jobId, data) => {
    const { rows } = await run.db.query('INSERT INTO charges (amount) VALUES ($1) RETURNING id', [data.amount]);
    if (process.env.JOBS_CRASH === 'mid-job') crash('mid-job: the charge is written, not committed');
    const result = { charge: Number(rows[0].id) };
    if (process.env.JOBS_ACK === 'transaction')
      await boss.complete(QUEUE, jobId, result, { db: { executeSql: (text, values) => run.db.query(text, values) } });
    return result;
  }, { key: (jobId) => jobId, scope: `pg-boss:${QUEUE}` });
}

// Ends the process at once, as a kill -9 would.
function crash(where) {
  console.error(`crashing (${where})`);
  process.kill(process.pid, 'SIGKILL');
}

// How long a delivery may run before pg-boss delivers the job again, in seconds.
const EXPIRE = Number(process.env.JOBS_EXPIRE_SECONDS ?? 60);
// How often pg-boss looks for deliveries past it (its monitor runs every 60 s by default).
const CHECK_EVERY = Math.max(1, Math.min(60, Math.ceil(EXPIRE / 2)));

// Returns a started pg-boss on DATABASE_URL, with the queue created.
async function startBoss() {
  const boss = new PgBoss({
    connectionString: process.env.DATABASE_URL,
    superviseIntervalSeconds: CHECK_EVERY, monitorIntervalSeconds: CHECK_EVERY,
  });
  boss.on('error', (err) => console.error('pg-boss:', err.message));
  await boss.start();
  if (!await boss.getQueue(QUEUE)) {
    await boss.createQueue(QUEUE, { expireInSeconds: EXPIRE, retryLimit: 20, retryDelay: 0 })
      .catch((err) => { if (!/exist/.test(err.message)) throw err; }); // another process made it meanwhile
  }
  return boss;
}

// Works on the queue until SIGTERM or SIGINT.
async function work() {
  await pool.query(`CREATE TABLE IF NOT EXISTS charges (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      amount numeric NOT NULL,
      created_at timestamptz NOT NULL DEFAULT now())`);
  const boss = await startBoss();
  const chargeOnce = chargeJob(boss);
  await boss.work(QUEUE, { batchSize: 1, pollingIntervalSeconds: 0.5 }, async ([job]) => {
    const result = await chargeOnce(job.id, job.data);
    if (process.env.JOBS_CRASH === 'after-commit') crash('after-commit: the charge committed, not acknowledged');
    return result; // pg-boss stores it as the job's output
  });
  console.log('working');
  const stop = async () => {
    await boss.stop({ graceful: true });
    await pool.end();
  };
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
}

// The redelivery storm: ORDERS units of work, each sent as DELIVERIES jobs
// (what a queue redelivering every job that often would hand the workers),
// worked on by WORKERS at once; the job wrapped in the function keyed by
// the order, or the bare handler. Prints jobs per second and how many
// effects (rows) the orders got.
const STORM = { orders: 100, deliveries: 20, workers: 8 };

// Runs the storm with the wrapped job (mode "once") or the bare handler ("bare").
async function storm(mode = 'once') {
  if (!['once', 'bare'].includes(mode)) throw new Error('storm once | bare');
  const queue = `storm-${mode}-${Date.now()}`;
  await pool.query('CREATE TABLE IF NOT EXISTS storm_effects (order_id int NOT NULL, mode text NOT NULL, queue text NOT NULL)');
  const effect = (db, order) => db.query('INSERT INTO storm_effects VALUES ($1, $2, $3)', [order, mode, queue]);
  const once = idempotent(pool, async (run, order) => {
    await effect(run.db, order);
    return { order };
  }, { key: (order) => `${queue}:${order}`, scope: 'storm', wait: '30 seconds' });
  const bare = async (order) => {
    const db = await pool.connect();
    try {
      await db.query('BEGIN');
      await effect(db, order);
      await db.query('COMMIT');
    } finally {
      db.release();
    }
    return { order };
  };
  const boss = await startBoss();
  await boss.createQueue(queue, { retryLimit: 5, retryDelay: 0 });
  const jobs = [];
  for (let d = 0; d < STORM.deliveries; d++)
    for (let order = 0; order < STORM.orders; order++) jobs.push({ data: { order } });
  await boss.insert(queue, jobs);
  const total = jobs.length;
  let done = 0;
  const started = process.hrtime.bigint();
  await new Promise((resolve) => {
    // Batches of 10 (one job at a time per worker), fetched again at once while batches come back full.
    boss.work(queue, {
      batchSize: 10, burstWhenBatchFull: true, localConcurrency: STORM.workers, pollingIntervalSeconds: 0.5,
    }, async (batch) => {
      for (const job of batch) await (mode === 'once' ? once : bare)(job.data.order);
      done += batch.length;
      if (done === total) resolve();
    });
  });
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  const { rows } = await pool.query(`SELECT sum(n)::int AS effects, count(*)::int AS orders, max(n)::int AS most
      FROM (SELECT order_id, count(*) AS n FROM storm_effects WHERE queue = $1 GROUP BY order_id) AS o`, [queue]);
  console.log(`${mode}: ${total} jobs (${STORM.orders} orders x ${STORM.deliveries}) over ${STORM.workers} workers: ` +
    `${(total / seconds).toFixed(0)} jobs/s; ${rows[0].effects} effects on ${rows[0].orders} orders, at most ${rows[0].most} per order`);
  await boss.stop({ graceful: false, wait: true });
  await pool.end();
}

// Sends a job charging amount; prints its id.
async function enqueue(amount) {
  const boss = await startBoss();
  console.log(await boss.send(QUEUE, { amount: Number(amount) }));
  await boss.stop({ graceful: false, wait: true });
  await pool.end();
}

// Prints the state and output of job id.
async function status(id) {
  const boss = new PgBoss({ connectionString: process.env.DATABASE_URL, supervise: false, schedule: false });
  boss.on('error', (err) => console.error('pg-boss:', err.message));
  await boss.start();
  const job = await boss.getJobById(QUEUE, id);
  console.log(job ? `${job.state} ${JSON.stringify(job.output ?? null)}` : 'none');
  await boss.stop({ graceful: false, wait: true });
  await pool.end();
}

const [command, arg] = process.argv.slice(2);
const commands = { worker: work, enqueue, status, storm };
if (!commands[command]) {
  console.error('usage: worker.js worker | enqueue AMOUNT | status ID | storm [once | bare]');
  process.exit(2);
}
commands[command](arg).catch((err) => {
  console.error(err);
  process.exit(1);
});
