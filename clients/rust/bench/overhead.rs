//! What the layer costs per request: database round trips and latency of a
//! fresh request and of a replay, against the same route without the layer.
//! Not a test (`cargo test` does not build it); run it with
//!
//!     DATABASE_URL=... clients/rust/bench/overhead [REQUESTS]
//!
//! The payment route (insert a charge, answer 201 `{"charge": id}`) is
//! served twice by hyper, each in a process of its own on 127.0.0.1:
//! "guarded", behind `IdempotencyLayer`, writing through its `Tx`; and
//! "plain", in a transaction of its own per request (`BEGIN`, insert,
//! `COMMIT`) on a connection of the same `Pool`. One client sends REQUESTS
//! (default 2000) sequential requests of each kind (plain; guarded with a
//! fresh key; guarded with a replayed key) over one kept-alive connection
//! per server. The kinds take turns, 100 timed requests at a time after 20
//! untimed, so that other load on the machine weighs on each alike; it
//! prints the median and 90th percentile.
//!
//! Round trips are counted apart, before the timing: the servers are started
//! once more behind a proxy on 127.0.0.1 that counts the ReadyForQuery
//! messages the database sends (one per Sync), and among them the
//! CloseComplete ones; 50 requests of each kind after 10 untimed. The proxy
//! adds a hop, so it is not there while timing. tokio-postgres prepares a
//! named statement for every query given as a string and closes it once it
//! has run, with a Close and a Sync that it sends without waiting for the
//! answer: those are counted apart ("closes"), and the round trips that a
//! request waits on are the other ReadyForQuery messages.

use std::convert::Infallible;
use std::error::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::service::{make_service_fn, service_fn};
use hyper::{Body, Request, Response, Server};
use pg_idempotency::tokio_postgres::config::Host;
use pg_idempotency::tokio_postgres::{Config, GenericClient};
use pg_idempotency::{IdempotencyLayer, Pool, Tx};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tower::Layer;

const WARMUP: usize = 20; // untimed requests before each batch
const BATCH: usize = 100; // timed requests of one kind in a row
const COUNTED: u64 = 50; // requests of each kind whose round trips are counted
const BODY: &str = r#"{"amount":10}"#;
const PROXY_PORT: &str = "BENCH_PROXY_PORT"; // tells a server to connect through the proxy

/// Runs the benchmark, or with `serve MODE` one of its servers.
fn main() {
    // cargo bench adds --bench: only the other arguments count.
    let args: Vec<String> = std::env::args().skip(1).filter(|arg| !arg.starts_with("--")).collect();
    if args.len() == 2 && args[0] == "serve" {
        return serve(&args[1]);
    }
    let requests = match args.first() {
        None => 2000,
        Some(n) => n.parse().ok().filter(|&n| n >= BATCH).unwrap_or_else(|| {
            fail(format!("usage: overhead [REQUESTS, at least {}]", BATCH))
        }),
    };
    let trips = count_round_trips();
    let latencies = time(requests / BATCH);
    println!("{} sequential requests of each kind, latency in µs:", requests / BATCH * BATCH);
    println!("{:<10}{:>8}{:>8}{:>13}{:>8}", "request", "median", "p90", "round trips", "closes");
    for ((name, mut latencies), (trips, closes)) in KINDS.iter().zip(latencies).zip(trips) {
        latencies.sort();
        println!(
            "{:<10}{:>8.0}{:>8.0}{:>13.1}{:>8.1}",
            name,
            micros(quantile(&latencies, 0.5)),
            micros(quantile(&latencies, 0.9)),
            trips,
            closes
        );
    }
}

/// The kinds of request, in the order they take turns.
const KINDS: [&str; 3] = ["plain", "fresh", "replay"];

/// The server and the Idempotency-Key of request `i` of kind `kind` (an index of KINDS).
fn request_of<'a>(kind: usize, i: usize, run: u128, servers: &'a mut [BenchServer; 2]) -> (&'a mut BenchServer, Option<String>) {
    let [plain, guarded] = servers;
    match kind {
        0 => (plain, None),
        1 => (guarded, Some(format!("fresh-{}-{}", run, i))),
        _ => (guarded, Some(format!("replay-{}", run))),
    }
}

/// Starts the plain and the guarded server (through the proxy on `proxy`, if any).
fn start_servers(proxy: Option<u16>) -> [BenchServer; 2] {
    [BenchServer::start("plain", proxy), BenchServer::start("guarded", proxy)]
}

/// An id of this run, for keys that no other run uses.
fn run_id() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_nanos()
}

/// Sends `batches` rounds of each kind; returns the latencies of each kind.
fn time(batches: usize) -> Vec<Vec<Duration>> {
    let mut servers = start_servers(None);
    let run = run_id();
    let mut latencies = vec![Vec::new(); KINDS.len()];
    let mut sent = 0;
    for _ in 0..batches {
        for (kind, timed) in latencies.iter_mut().enumerate() {
            for i in 0..WARMUP + BATCH {
                sent += 1;
                let (server, key) = request_of(kind, sent, run, &mut servers);
                let elapsed = server.pay(key.as_deref());
                if i >= WARMUP {
                    timed.push(elapsed);
                }
            }
        }
    }
    latencies
}

/// Returns the round trips and the statement closes per request of each
/// kind, counted by the proxy.
fn count_round_trips() -> Vec<(f64, f64)> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime");
    let counts = Arc::new(Counts::default());
    let proxy = runtime.block_on(start_proxy(database_config(), counts.clone()));
    let mut servers = start_servers(Some(proxy));
    let run = run_id();
    let mut per_request = Vec::new();
    for kind in 0..KINDS.len() {
        let mut before = (0, 0);
        for i in 0..10 + COUNTED {
            if i == 10 {
                before = counts.read();
            }
            let (server, key) = request_of(kind, i as usize, run, &mut servers);
            server.pay(key.as_deref());
        }
        // The closes of the last request may still be on their way: let them arrive.
        std::thread::sleep(Duration::from_millis(100));
        let (syncs, closes) = counts.read();
        let closes = (closes - before.1) as f64 / COUNTED as f64;
        per_request.push(((syncs - before.0) as f64 / COUNTED as f64 - closes, closes));
    }
    per_request
}

/// What the proxy counted: ReadyForQuery messages, and CloseComplete ones.
#[derive(Default)]
struct Counts {
    ready_for_query: AtomicU64,
    close_complete: AtomicU64,
}

impl Counts {
    /// Returns (ReadyForQuery, CloseComplete) so far.
    fn read(&self) -> (u64, u64) {
        (self.ready_for_query.load(Ordering::SeqCst), self.close_complete.load(Ordering::SeqCst))
    }
}

/// Returns the q-quantile of sorted durations (linear interpolation).
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let position = q * (sorted.len() - 1) as f64;
    let i = position as usize;
    match sorted.get(i + 1) {
        Some(next) => sorted[i] + (*next - sorted[i]).mul_f64(position - i as f64),
        None => sorted[i],
    }
}

/// Returns d in microseconds.
fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Prints why and exits with 1.
fn fail(why: impl std::fmt::Display) -> ! {
    eprintln!("overhead: {}", why);
    std::process::exit(1)
}

/// DATABASE_URL, parsed.
fn database_config() -> Config {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| fail("set DATABASE_URL"));
    url.parse().unwrap_or_else(|err| fail(format!("DATABASE_URL: {}", err)))
}

/// A server process and one kept-alive connection to it.
struct BenchServer {
    child: Child,
    stream: TcpStream,
}

impl BenchServer {
    /// Runs this program as the server of `mode` and connects to it.
    fn start(mode: &str, proxy: Option<u16>) -> BenchServer {
        let mut command = Command::new(std::env::current_exe().expect("this program's path"));
        command.args(["serve", mode]).stdin(Stdio::piped()).stdout(Stdio::piped());
        if let Some(port) = proxy {
            command.env(PROXY_PORT, port.to_string());
        }
        let mut child = command.spawn().unwrap_or_else(|err| fail(format!("cannot start a server: {}", err)));
        let address = first_line(child.stdout.take().expect("piped"));
        let stream = TcpStream::connect(address.trim()).unwrap_or_else(|err| fail(format!("the {} server: {}", mode, err)));
        stream.set_nodelay(true).expect("TCP_NODELAY");
        BenchServer { child, stream }
    }

    /// Sends one payment (with `key` as its Idempotency-Key); returns its latency.
    fn pay(&mut self, key: Option<&str>) -> Duration {
        let mut request = format!(
            "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Authorization: Bearer bench\r\nContent-Length: {}\r\n",
            BODY.len()
        );
        if let Some(key) = key {
            request += &format!("Idempotency-Key: {}\r\n", key);
        }
        request += "\r\n";
        request += BODY;
        let began = Instant::now();
        self.stream.write_all(request.as_bytes()).unwrap_or_else(|err| fail(err));
        let status = self.read_response();
        let elapsed = began.elapsed();
        if status != 201 {
            fail(format!("POST /payments answered {}", status));
        }
        elapsed
    }

    /// Reads one whole response (it has a Content-Length); returns its status.
    fn read_response(&mut self) -> u16 {
        let mut buffer = Vec::new();
        let mut chunk = [0; 4096];
        loop {
            let n = self.stream.read(&mut chunk).unwrap_or_else(|err| fail(err));
            if n == 0 {
                fail("the server closed the connection");
            }
            buffer.extend_from_slice(&chunk[..n]);
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut response = httparse::Response::new(&mut headers);
            let head = match response.parse(&buffer) {
                Ok(httparse::Status::Complete(head)) => head,
                Ok(httparse::Status::Partial) => continue,
                Err(err) => fail(format!("not an HTTP response: {}", err)),
            };
            let length = response
                .headers
                .iter()
                .find(|header| header.name.eq_ignore_ascii_case("content-length"))
                .and_then(|header| std::str::from_utf8(header.value).ok()?.parse::<usize>().ok())
                .unwrap_or_else(|| fail("a response without Content-Length"));
            if buffer.len() >= head + length {
                return response.code.expect("a complete response has a status");
            }
        }
    }
}

impl Drop for BenchServer {
    /// Ends the server process (closing its standard input ends it too).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the first line a server prints: its address.
fn first_line(stdout: ChildStdout) -> String {
    let mut line = String::new();
    if BufReader::new(stdout).read_line(&mut line).unwrap_or(0) == 0 {
        fail("a server did not start");
    }
    line
}

/// A connection to the database, TCP or Unix socket.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Connects to the database `config` names, as tokio-postgres would (its first host).
async fn connect_upstream(config: &Config) -> std::io::Result<Box<dyn Stream>> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    Ok(match config.get_hosts().first() {
        Some(Host::Tcp(host)) => Box::new(tokio::net::TcpStream::connect((host.as_str(), port)).await?),
        Some(Host::Unix(dir)) => Box::new(tokio::net::UnixStream::connect(dir.join(format!(".s.PGSQL.{}", port))).await?),
        None => Box::new(tokio::net::TcpStream::connect(("localhost", port)).await?),
    })
}

/// Starts a proxy on 127.0.0.1 to the database of `config` that counts the
/// messages the database sends through it in `counts`. Returns its port.
async fn start_proxy(config: Config, counts: Arc<Counts>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port for the proxy");
    let port = listener.local_addr().expect("bound").port();
    tokio::spawn(async move {
        loop {
            let (client, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(_) => continue,
            };
            let upstream = connect_upstream(&config).await.unwrap_or_else(|err| fail(format!("the proxy: {}", err)));
            let counts = counts.clone();
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = tokio::io::split(client);
                let (mut from_server, mut to_server) = tokio::io::split(upstream);
                let upward = tokio::spawn(async move { tokio::io::copy(&mut from_client, &mut to_server).await });
                let mut frames = Frames::default();
                let mut buffer = vec![0; 16384];
                while let Ok(n) = from_server.read(&mut buffer).await {
                    if n == 0 || to_client.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                    frames.count(&buffer[..n], &counts);
                }
                upward.abort();
            });
        }
    });
    port
}

/// Follows the framing of the messages a PostgreSQL server sends (a type
/// byte, a 4-byte length that counts itself, the rest) across reads. The
/// stream is framed from its first byte: with NoTls no SSLRequest is sent.
#[derive(Default)]
struct Frames {
    header: [u8; 5],
    have: usize, // bytes of the header read so far
    skip: usize, // bytes of the current message's body still to pass
}

impl Frames {
    /// Takes the next bytes; counts the ReadyForQuery and CloseComplete
    /// messages that begin in them.
    fn count(&mut self, mut bytes: &[u8], counts: &Counts) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let step = self.skip.min(bytes.len());
                self.skip -= step;
                bytes = &bytes[step..];
                continue;
            }
            let step = (self.header.len() - self.have).min(bytes.len());
            self.header[self.have..self.have + step].copy_from_slice(&bytes[..step]);
            self.have += step;
            bytes = &bytes[step..];
            if self.have == self.header.len() {
                match self.header[0] {
                    b'Z' => counts.ready_for_query.fetch_add(1, Ordering::SeqCst),
                    b'3' => counts.close_complete.fetch_add(1, Ordering::SeqCst),
                    _ => 0,
                };
                let length = u32::from_be_bytes([self.header[1], self.header[2], self.header[3], self.header[4]]);
                self.skip = (length as usize).saturating_sub(4);
                self.have = 0;
            }
        }
    }
}

/// Serves the payment route of `mode` (guarded or plain) on 127.0.0.1,
/// prints its address, and exits when its standard input closes.
fn serve(mode: &str) {
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    let pool = Pool::new(server_config(), pg_idempotency::tokio_postgres::NoTls, 10);
    let result = runtime.block_on(async move {
        let db = pool.get().await?;
        db.batch_execute(
            "CREATE TABLE IF NOT EXISTS charges (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                amount numeric NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
        drop(db);
        if mode == "guarded" {
            listen(IdempotencyLayer::new(pool).layer(service_fn(pay_guarded))).await
        } else {
            listen(service_fn(move |request| pay_plain(pool.clone(), request))).await
        }
    });
    if let Err(err) = result {
        fail(format!("the {} server: {}", mode, err));
    }
}

/// DATABASE_URL, or through the proxy when BENCH_PROXY_PORT says so.
fn server_config() -> Config {
    let config = database_config();
    let port = match std::env::var(PROXY_PORT) {
        Ok(port) => port.parse().unwrap_or_else(|_| fail("a bad proxy port")),
        Err(_) => return config,
    };
    let mut via = Config::new();
    via.host("127.0.0.1").port(port);
    if let Some(user) = config.get_user() {
        via.user(user);
    }
    if let Some(password) = config.get_password() {
        via.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        via.dbname(dbname);
    }
    via
}

/// Serves `service` on a free port of 127.0.0.1, after printing the address.
async fn listen<S, B>(service: S) -> Result<(), Box<dyn Error + Send + Sync>>
where
    S: tower::Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: hyper::body::HttpBody + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn Error + Send + Sync>>,
{
    let server = Server::try_bind(&SocketAddr::from(([127, 0, 0, 1], 0)))?.tcp_nodelay(true).serve(make_service_fn(
        move |_| {
            let service = service.clone();
            async move { Ok::<_, Infallible>(service) }
        },
    ));
    println!("{}", server.local_addr());
    std::io::stdout().flush()?;
    server.await?;
    Ok(())
}

/// The guarded route: charges in the layer's transaction.
async fn pay_guarded(request: Request<Body>) -> Result<Response<Body>, Infallible> {
    let tx = request.extensions().get::<Tx>().cloned().expect("behind the layer");
    let db = match tx.client().await {
        Ok(db) => db,
        Err(err) => return Ok(answer(500, err.to_string())),
    };
    Ok(charge(&*db, request).await)
}

/// The plain route: charges in a transaction of its own (BEGIN ... COMMIT).
async fn pay_plain(pool: Pool, request: Request<Body>) -> Result<Response<Body>, Infallible> {
    let mut conn = match pool.get().await {
        Ok(conn) => conn,
        Err(err) => return Ok(answer(503, err.to_string())),
    };
    let tx = match conn.transaction().await {
        Ok(tx) => tx,
        Err(err) => return Ok(answer(503, err.to_string())),
    };
    let response = charge(&tx, request).await;
    if response.status() != 201 {
        return Ok(response); // the transaction rolls back when dropped
    }
    Ok(match tx.commit().await {
        Ok(()) => response,
        Err(err) => answer(500, err.to_string()),
    })
}

/// Inserts the charge of `request` through `db`; answers 201 `{"charge": id}`.
async fn charge<C: GenericClient>(db: &C, request: Request<Body>) -> Response<Body> {
    let body = match hyper::body::to_bytes(request.into_body()).await {
        Ok(body) => body,
        Err(err) => return answer(400, err.to_string()),
    };
    let amount = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(payment) if payment["amount"].as_f64().map_or(false, |amount| amount > 0.0) => payment["amount"].to_string(),
        _ => return answer(400, "amount must be a positive number".into()),
    };
    let sql = "INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id";
    match db.query_one(sql, &[&amount]).await {
        Ok(row) => {
            let mut response = answer(201, format!("{{\"charge\":{}}}", row.get::<_, i64>(0)));
            response.headers_mut().insert("content-type", "application/json".parse().expect("a header value"));
            response
        }
        Err(err) => answer(500, err.to_string()),
    }
}

/// A response of `status` with `body`.
fn answer(status: u16, body: String) -> Response<Body> {
    Response::builder().status(status).body(Body::from(body)).expect("a valid response")
}
