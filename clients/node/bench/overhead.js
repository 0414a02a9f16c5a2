'use strict';
// Measures what the middleware costs per request: statements sent to the
// database and latency (median, p99) of a fresh request and of a replay,
// against the same route without it and under the hand-written recipe
// (recipe.js), in both of the middleware's modes (one transaction also with
// the prepare option, its best mode on a direct connection); prints the speed of each
// mode against the recipe (the recipe's median latency over the mode's:
// above 1.0x, the middleware is faster). One client, requests one after
// another over a kept-alive connection; each server in its own process.
//   DATABASE_URL=... node bench/overhead.js [requests per case, default 2000]
// Run from a directory where pg-idempotency, express and pg resolve.

const { fork } = require('node:child_process');
const http = require('node:http');
const path = require('node:path');

const N = Number(process.argv[2] ?? 2000);
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 }); // one connection per server

// Sends one request; resolves to its latency in milliseconds.
function request(port, method, urlPath, headers = {}, body = null) {
  return new Promise((resolve, reject) => {
    const started = process.hrtime.bigint();
    const req = http.request({ host: '127.0.0.1', port, method, path: urlPath, agent, headers }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        if (res.statusCode >= 300) return reject(new Error(`${res.statusCode} ${Buffer.concat(chunks)}`));
        resolve({ ms: Number(process.hrtime.bigint() - started) / 1e6, body: Buffer.concat(chunks) });
      });
    });
    req.on('error', reject);
    req.end(body);
  });
}

// Returns the p-th percentile of sorted numbers.
function percentile(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

// Returns the statements a server has sent so far.
async function statements(port) {
  return JSON.parse((await request(port, 'GET', '/stats')).body).statements;
}

// Sends payment i of a case (its key(i) as Idempotency-Key, or none); resolves to the latency.
async function pay(c, i) {
  const headers = { 'Content-Type': 'application/json', Authorization: 'Bearer bench' };
  if (c.key) headers['Idempotency-Key'] = c.key(i);
  return (await request(c.port, 'POST', '/payments', headers, '{"amount":10}')).ms;
}

// Starts bench/server.js in mode; resolves to { port, stop }.
function start(mode) {
  return new Promise((resolve) => {
    const child = fork(path.join(__dirname, 'server.js'), [mode], { stdio: 'inherit' });
    child.once('message', (port) => resolve({ port, stop: () => child.kill() }));
  });
}

// Interleaves the cases request by request, so that the load of the machine weighs on all alike.
async function main() {
  const prefix = `bench-${Date.now()}`;
  const cases = [
    { name: 'no middleware, no transaction', mode: 'plain', key: null },
    { name: 'no middleware, a transaction', mode: 'transaction', key: null },
    { name: 'middleware: fresh key', mode: 'middleware', key: (i) => `${prefix}-fresh-${i}` },
    { name: 'middleware: replay', mode: 'middleware', key: () => `${prefix}-replay` },
    { name: 'middleware, one transaction: fresh key', mode: 'middleware-one', key: (i) => `${prefix}-fresh1-${i}` },
    { name: 'middleware, one transaction: replay', mode: 'middleware-one', key: () => `${prefix}-replay1` },
    { name: 'middleware, one transaction, prepared: fresh key', mode: 'middleware-one-prepared', key: (i) => `${prefix}-fresh1p-${i}` },
    { name: 'middleware, one transaction, prepared: replay', mode: 'middleware-one-prepared', key: () => `${prefix}-replay1p` },
    { name: 'hand-written recipe: fresh key', mode: 'recipe', key: (i) => `${prefix}-freshr-${i}` },
    { name: 'hand-written recipe: replay', mode: 'recipe', key: () => `${prefix}-replayr` },
  ];
  for (const c of cases) Object.assign(c, await start(c.mode), { latencies: [] });
  for (let i = -200; i < N; i++) { // 200 warm-up rounds, not counted
    if (i === 0) for (const c of cases) c.before = await statements(c.port);
    for (const c of cases) {
      const ms = await pay(c, i);
      if (i >= 0) c.latencies.push(ms);
    }
  }
  console.log(`${N} POST /payments per case, one at a time, the cases interleaved\n`);
  console.log('| case | median ms | p99 ms | statements per request |\n| --- | --- | --- | --- |');
  for (const c of cases) {
    const sorted = c.latencies.sort((a, b) => a - b);
    const perRequest = ((await statements(c.port)) - c.before) / N;
    c.median = percentile(sorted, 50);
    console.log(`| ${c.name} | ${c.median.toFixed(3)} | ${percentile(sorted, 99).toFixed(3)} | ${perRequest} |`);
    c.stop();
  }
  agent.destroy();
  const median = (name) => cases.find((c) => c.name === name).median;
  console.log('\nours ÷ hand-written (the recipe\'s median latency over ours; above 1.0x ours is faster)\n');
  console.log('| mode | fresh keys | replays |\n| --- | --- | --- |');
  for (const [mode, prefix] of [['two transactions', 'middleware'], ['one transaction', 'middleware, one transaction'],
    ['one transaction, prepared', 'middleware, one transaction, prepared']]) {
    const ratio = (work) => (median(`hand-written recipe: ${work}`) / median(`${prefix}: ${work}`)).toFixed(2);
    console.log(`| ${mode} | ${ratio('fresh key')}x | ${ratio('replay')}x |`);
  }
}

main().catch((err) => { console.error(err); process.exit(1); });
