#!/usr/bin/env node
'use strict';
// A fault-injecting TCP proxy between an application and PostgreSQL, for
// tests (Node's standard library only). It forwards the wire protocol and,
// on command, loses a database answer the way a network does:
//
//   node faultproxy.js --target HOST:PORT [--listen PORT] [--control PORT]
//
// It listens on 127.0.0.1 (--listen, default a free port) and connects every
// client to --target. When both ports are bound it prints one JSON line,
// {"listen": PORT, "control": PORT}, on stdout. The control interface is
// HTTP on 127.0.0.1 (--control, default a free port); every answer is JSON:
//
//   POST /cut?match=REGEX[&times=N][&scope=statement|transaction][&keep=server]
//       Arms a cut (replacing any armed one): the next N (default 1) times a
//       client sends a statement whose SQL text matches REGEX (JavaScript,
//       case-insensitive; the text of a Query, or of the Parse behind the
//       Bind behind an Execute: a Parse or Describe alone does not count),
//       the proxy lets the server answer and, once the server's
//       ReadyForQuery has arrived, closes both sides of that connection
//       instead of passing the answer on. The server has done the work; the
//       client gets a closed connection. scope=statement (default) cuts at
//       the ReadyForQuery of the Sync or Query that carried the statement;
//       scope=transaction cuts at the first ReadyForQuery that says the
//       connection is idle again (the statement's own when it ran on its
//       own, the COMMIT's or ROLLBACK's inside BEGIN ... COMMIT), passing the
//       answers before that one on as usual. keep=server closes only the
//       client's side: the server's stays open, unread, as a half-open
//       connection leaves it (its transaction goes on) until /drop.
//   POST /refuse?count=N      closes the next N new connections at once, before
//                             any byte reaches the server.
//   POST /refuse?ms=T         stops listening for T milliseconds: connecting is
//                             refused (ECONNREFUSED) meanwhile.
//   POST /drop                closes every open connection now, and the
//                             server sides kept open by keep=server cuts.
//   POST /reset               disarms everything and zeroes the counters.
//   GET  /stats               the counters: connections (accepted and
//                             forwarded), open, matched (statements that
//                             matched the armed cut), cuts (done), refused,
//                             dropped, kept (server sides kept open now);
//                             and armed (the cut still to do, or null).
//
// The protocol: a client's SSLRequest or GSSENCRequest is answered 'N' (go
// on unencrypted: sslmode=require cannot go through this proxy); a
// CancelRequest is passed through as is. After the startup message every
// message in either direction is framed by its type byte and length, which
// is how the proxy knows where each Query, Parse, Bind, Sync and
// ReadyForQuery starts and ends. Each Sync or Query gets exactly one
// ReadyForQuery, in order, so a queue of them says which answer belongs to
// which request, also when a client pipelines.

const net = require('node:net');
const http = require('node:http');

const SSL_REQUEST = 80877103;
const GSSENC_REQUEST = 80877104;
const CANCEL_REQUEST = 80877102;

const stats = { connections: 0, open: 0, matched: 0, cuts: 0, refused: 0, dropped: 0 };
let armed = null; // { match: RegExp, times, scope, keepServer }
let refuseCount = 0;
const sessions = new Set();
const keptServers = new Set(); // server sockets whose client was cut with keep=server

// Parses --name value arguments into an object.
function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || argv[i + 1] === undefined) usage(`bad argument ${argv[i]}`);
    args[argv[i].slice(2)] = argv[i + 1];
  }
  if (!args.target) usage('--target HOST:PORT is required');
  return args;
}

// Prints how to call the proxy and exits.
function usage(message) {
  console.error(`faultproxy: ${message}\nusage: faultproxy.js --target HOST:PORT [--listen PORT] [--control PORT]`);
  process.exit(2);
}

// Splits complete length-framed messages off a buffer; returns [messages, rest].
// typed: messages start with a type byte (all but the startup phase's).
function frames(buf, typed) {
  const out = [];
  const head = typed ? 1 : 0;
  let at = 0;
  while (buf.length - at >= head + 4) {
    const len = buf.readInt32BE(at + head);
    if (len < 4) throw new Error(`bad message length ${len}`);
    const end = at + head + len;
    if (end > buf.length) break;
    out.push(buf.subarray(at, end));
    at = end;
  }
  return [out, buf.subarray(at)];
}

// Reads the NUL-terminated string at offset; returns [string, next offset].
function cstring(buf, offset) {
  const end = buf.indexOf(0, offset);
  return [buf.toString('utf8', offset, end), end + 1];
}

// Decides whether a statement's SQL text hits the armed cut (and counts it
// down): returns the cut ({ scope, keepServer }), or null.
function hits(sql) {
  if (!armed || armed.times <= 0 || !armed.match.test(sql)) return null;
  armed.times -= 1;
  stats.matched += 1;
  return { scope: armed.scope, keepServer: armed.keepServer };
}

// One client connection and its server connection.
class Session {
  constructor(client, target) {
    this.client = client;
    this.server = net.connect(target);
    this.typed = false; // the client has sent its startup message
    this.fromClient = Buffer.alloc(0);
    this.fromServer = Buffer.alloc(0);
    this.raw = false; // a CancelRequest: pass bytes through unparsed
    // One entry per ReadyForQuery to come (the startup's first): the cut
    // to make at it, or null.
    this.pending = [null];
    this.extended = null; // the cut hit by the extended-protocol messages since the last Sync
    this.statements = new Map(); // prepared statement name => SQL text
    this.portals = new Map(); // portal name => the SQL text of its statement
    this.cutAtIdle = null; // scope=transaction: the cut to make at the next idle ReadyForQuery
    this.held = []; // server messages held back until the ReadyForQuery that decides
    this.closed = false;
    sessions.add(this);
    stats.connections += 1;
    stats.open += 1;

    client.on('data', (chunk) => this.onClient(chunk));
    this.server.on('data', (chunk) => this.onServer(chunk));
    for (const socket of [client, this.server]) {
      socket.on('error', () => this.close());
      socket.on('close', () => this.close());
    }
  }

  // Closes both sides (once); what was passed to the client before still reaches it.
  close() {
    if (this.closed) return;
    this.closed = true;
    sessions.delete(this);
    stats.open -= 1;
    this.client.uncork(); // the messages forwarded from this read, before the cut
    this.client.destroySoon();
    this.server.destroy();
  }

  // Closes the client's side only, leaving the server's open and unread.
  closeClient() {
    for (const event of ['close', 'error', 'data']) {
      this.client.removeAllListeners(event);
      this.server.removeAllListeners(event);
    }
    this.client.on('error', () => {});
    this.server.on('error', () => {});
    this.server.pause();
    keptServers.add(this.server);
    this.server.on('close', () => keptServers.delete(this.server));
    this.closed = true;
    sessions.delete(this);
    stats.open -= 1;
    this.client.uncork();
    this.client.destroySoon();
  }

  // Reads client bytes: the startup phase, then typed messages.
  onClient(chunk) {
    if (this.closed) return;
    if (this.raw) return this.server.write(chunk);
    this.fromClient = Buffer.concat([this.fromClient, chunk]);
    let messages;
    try {
      [messages, this.fromClient] = frames(this.fromClient, this.typed);
    } catch {
      return this.close();
    }
    this.server.cork();
    for (const m of messages) {
      if (this.typed) this.clientMessage(m);
      else this.startupMessage(m);
      if (this.closed) return;
    }
    this.server.uncork();
  }

  // Handles an untyped message of the startup phase.
  startupMessage(m) {
    const code = m.length >= 8 ? m.readInt32BE(4) : 0;
    if (code === SSL_REQUEST || code === GSSENC_REQUEST) return this.client.write('N');
    this.server.write(m);
    if (code === CANCEL_REQUEST) this.raw = true;
    else this.typed = true; // the startup message; every later message is typed
  }

  // Notes what a typed client message asks for, then forwards it.
  clientMessage(m) {
    const type = String.fromCharCode(m[0]);
    if (type === 'Q') {
      this.pending.push(hits(cstring(m, 5)[0]));
    } else if (type === 'P') {
      const [name, next] = cstring(m, 5);
      this.statements.set(name, cstring(m, next)[0]);
    } else if (type === 'B') {
      const [portal, next] = cstring(m, 5);
      this.portals.set(portal, this.statements.get(cstring(m, next)[0]) ?? '');
    } else if (type === 'E') { // only an execution counts: a Parse or Describe alone runs nothing
      this.extended ??= hits(this.portals.get(cstring(m, 5)[0]) ?? '');
    } else if (type === 'S') {
      this.pending.push(this.extended);
      this.extended = null;
    } else if (type === 'F') { // a function call: answered with a ReadyForQuery of its own
      this.pending.push(null);
    }
    this.server.write(m);
  }

  // Reads server bytes, forwarding each message unless a cut holds it back.
  onServer(chunk) {
    if (this.closed) return;
    if (this.raw) return this.client.write(chunk);
    this.fromServer = Buffer.concat([this.fromServer, chunk]);
    let messages;
    try {
      [messages, this.fromServer] = frames(this.fromServer, true);
    } catch {
      return this.close();
    }
    this.client.cork();
    for (const m of messages) {
      this.serverMessage(m);
      if (this.closed) return;
    }
    this.client.uncork();
  }

  // Forwards one server message, holds it, or (at the deciding ReadyForQuery) cuts.
  serverMessage(m) {
    const cut = this.pending[0] ?? null;
    const holding = cut !== null || this.cutAtIdle !== null;
    if (m[0] !== 0x5a /* Z: ReadyForQuery */) {
      if (holding) this.held.push(m);
      else this.client.write(m);
      return;
    }
    this.pending.shift();
    const idle = m[5] === 0x49; // 'I': not in a transaction
    if (cut?.scope === 'transaction' && !idle) {
      this.cutAtIdle = cut; // the statement's transaction goes on: cut at its end
    } else if (cut !== null || (this.cutAtIdle !== null && idle)) {
      stats.cuts += 1;
      return (cut ?? this.cutAtIdle).keepServer ? this.closeClient() : this.close();
    }
    for (const held of this.held) this.client.write(held);
    this.held = [];
    this.client.write(m);
  }
}

// Accepts a client: refuses it when told to, else proxies it.
function accept(client, target) {
  client.setNoDelay(true);
  if (refuseCount > 0) {
    refuseCount -= 1;
    stats.refused += 1;
    client.on('error', () => {});
    return client.destroy();
  }
  const session = new Session(client, target);
  session.server.setNoDelay(true);
}

// Answers a control request.
function control(req, res, proxy, listenPort) {
  const url = new URL(req.url, 'http://control');
  const q = url.searchParams;
  const send = (status, body) => {
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(`${JSON.stringify(body)}\n`);
  };
  const route = `${req.method} ${url.pathname}`;
  if (route === 'GET /stats')
    return send(200, { ...stats, kept: keptServers.size, armed: armed && { ...armed, match: armed.match.source } });
  if (route === 'POST /cut') {
    let match;
    try {
      match = new RegExp(q.get('match') ?? '', 'i');
    } catch (err) {
      return send(400, { error: err.message });
    }
    const times = Number(q.get('times') ?? 1);
    const scope = q.get('scope') ?? 'statement';
    const keep = q.get('keep');
    if (!q.get('match') || !Number.isInteger(times) || times < 1 || !['statement', 'transaction'].includes(scope) ||
        ![null, 'server'].includes(keep))
      return send(400, { error: 'cut needs match=REGEX, times a positive integer, scope statement or transaction, keep server or nothing' });
    armed = { match, times, scope, keepServer: keep === 'server' };
    return send(200, { armed: { match: match.source, times, scope, keepServer: armed.keepServer } });
  }
  if (route === 'POST /refuse') {
    const count = Number(q.get('count') ?? 0);
    const ms = Number(q.get('ms') ?? 0);
    if (!Number.isInteger(count) || !Number.isInteger(ms) || count < 0 || ms < 0 || (count > 0) === (ms > 0))
      return send(400, { error: 'refuse needs one of count=N or ms=T, positive integers' });
    refuseCount += count;
    if (ms > 0 && proxy.listening) {
      proxy.close();
      setTimeout(() => proxy.listen(listenPort, '127.0.0.1'), ms);
    }
    return send(200, { refusing: count || `${ms} ms` });
  }
  if (route === 'POST /drop') {
    for (const s of [...sessions]) {
      stats.dropped += 1;
      s.close();
    }
    for (const server of [...keptServers]) server.destroy();
    return send(200, { dropped: stats.dropped });
  }
  if (route === 'POST /reset') {
    armed = null;
    refuseCount = 0;
    for (const name of Object.keys(stats)) if (name !== 'open') stats[name] = 0;
    return send(200, stats);
  }
  return send(404, { error: `no ${route}` });
}

// Starts the proxy and its control interface; prints their ports.
function main() {
  const args = parseArgs(process.argv.slice(2));
  const [host, port] = args.target.split(/:(?=\d+$)/);
  const target = { host, port: Number(port) };
  if (!host || !Number.isInteger(target.port)) usage(`bad --target ${args.target}`);
  const proxy = net.createServer((client) => accept(client, target));
  proxy.listen(Number(args.listen ?? 0), '127.0.0.1', () => {
    const listenPort = proxy.address().port;
    const ctl = http.createServer((req, res) => control(req, res, proxy, listenPort));
    ctl.listen(Number(args.control ?? 0), '127.0.0.1', () => {
      console.log(JSON.stringify({ listen: listenPort, control: ctl.address().port }));
    });
  });
  process.on('SIGTERM', () => process.exit(0));
}

main();
