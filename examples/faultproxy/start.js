'use strict';
// Starts faultproxy.js in a child process, for Node tests:
//   const { startProxy } = require('.../examples/faultproxy/start.js');
//   const proxy = await startProxy('127.0.0.1:5432');
//   proxy.port; await proxy.control('POST', '/cut?match=...'); proxy.stop();

const path = require('node:path');
const { spawn } = require('node:child_process');

// Starts a proxy in front of target (HOST:PORT); resolves to
// { port, control(method, route) => the JSON answer, stop() }.
function startProxy(target) {
  const child = spawn(process.execPath, [path.join(__dirname, 'faultproxy.js'), '--target', target],
    { stdio: ['ignore', 'pipe', 'inherit'] });
  return new Promise((resolve, reject) => {
    child.on('error', reject);
    child.stdout.once('data', (line) => {
      const { listen, control } = JSON.parse(line);
      resolve({
        port: listen,
        async control(method, route) {
          const res = await fetch(`http://127.0.0.1:${control}${route}`, { method });
          const body = await res.json();
          if (!res.ok) throw new Error(`${route}: ${res.status} ${JSON.stringify(body)}`);
          return body;
        },
        stop: () => child.kill(),
      });
    });
  });
}

module.exports = { startProxy };
