'use strict';
// Sends KEYS keys, each TIMES times at once (all KEYS * TIMES requests
// together), to the app at URL; prints the answers' statuses as JSON.
//   node duplicates.js URL PREFIX [KEYS=25] [TIMES=8]
const http = require('node:http');

const [url, prefix, keys = 25, times = 8] = process.argv.slice(2);
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });

// Posts one payment with key; resolves to its status (0 when the connection failed).
function post(key) {
  return new Promise((resolve) => {
    const body = '{"amount":1}';
    const req = http.request(`${url}/payments`, {
      method: 'POST', agent,
      headers: { 'Content-Type': 'application/json', 'Content-Length': body.length,
        Authorization: 'Bearer bench', 'Idempotency-Key': key },
    }, (res) => { res.resume(); res.on('end', () => resolve(res.statusCode)); });
    req.on('error', () => resolve(0));
    req.end(body);
  });
}

const sends = [];
for (let k = 0; k < Number(keys); k++)
  for (let t = 0; t < Number(times); t++) sends.push(post(`${prefix}-${k}`));
Promise.all(sends).then((statuses) => {
  const counts = {};
  for (const s of statuses) counts[s] = (counts[s] ?? 0) + 1;
  console.log(JSON.stringify(counts));
});
