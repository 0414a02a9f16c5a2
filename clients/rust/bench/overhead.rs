//! What the layer costs per request: database round trips and latency of a
//! fresh request and of a replay, against the same route without the layer.
//! Not a test (`cargo test` does not build it); run it with
//!
//!     DATABASE_URL=... clients/rust/bench/overhead [REQUESTS]
//!
//! The payment route (insert a charge, answer 201 `{"charge": id}`) is
//! served twice by axum, each in a process of its own on 127.0.0.1:
//! "guarded", behind `IdempotencyLayer`, writing through its `Tx`; and
//! "plain", in a transaction of its own per request (`pool.begin()`,
//! insert, `commit()`) on the same kind of `PgPool` (SQLx's defaults, 10
//! connections). One client sends REQUESTS
//! (default 2000) sequential requests of each kind (plain; guarded with a
//! fresh key; guarded with a replayed key) over one kept-alive connection
//! per server. The kinds take turns, 100 timed requests at a time after 20
//! untimed, so that other load on the machine weighs on each alike; it
//! prints the median and 90th percentile. IDEMPOTENCY_ONE_TRANSACTION=on
//! measures the layer's one-transaction mode.
//!
//! Round trips are counted apart, before the timing: the servers are started
//! once more behind a proxy on 127.0.0.1 that counts the ReadyForQuery
//! messages the database sends (one per Sync), and among them the
//! CloseComplete ones; 50 requests of each kind after 10 untimed. The proxy
//! adds a hop, so it is not there while timing. SQLx closes the unnamed
//! portal of each prepared statement it runs ("closes"), in the same
//! exchange: a round trip is one ReadyForQuery, whatever it answered. SQLx
//! pings a connection (a Sync) when it is taken from the pool and again, in
//! the background, when it goes back: those pings are among the round trips.

use std::error::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::Response;
use axum::routing::post;
use axum::serve::ListenerExt;
use pg_idempotency::{IdempotencyLayer, Tx};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{PgConnection, PgPool};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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
fn request_of(kind: usize, i: usize, run: u128, servers: &mut [BenchServer; 2]) -> (&mut BenchServer, Option<String>) {
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
    let proxy = runtime.block_on(start_proxy(database_options(), counts.clone()));
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
        // A CloseComplete answers a Close sent with the Bind and Execute, before
        // the same Sync: it is no round trip of its own.
        per_request.push(((syncs - before.0) as f64 / COUNTED as f64, closes));
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
fn database_options() -> PgConnectOptions {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| fail("set DATABASE_URL"));
    url.parse().unwrap_or_else(|err| fail(format!("DATABASE_URL: {err}")))
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

/// Connects to the database `options` names, as SQLx would.
async fn connect_upstream(options: &PgConnectOptions) -> std::io::Result<Box<dyn Stream>> {
    let port = options.get_port();
    Ok(match options.get_socket() {
        Some(dir) => Box::new(tokio::net::UnixStream::connect(dir.join(format!(".s.PGSQL.{port}"))).await?),
        None => Box::new(tokio::net::TcpStream::connect((options.get_host(), port)).await?),
    })
}

/// Starts a proxy on 127.0.0.1 to the database of `config` that counts the
/// messages the database sends through it in `counts`. Returns its port.
async fn start_proxy(config: PgConnectOptions, counts: Arc<Counts>) -> u16 {
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
/// stream is framed from its first byte: the servers connect through the
/// proxy with sslmode=disable, so no SSLRequest is sent.
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
    let result = runtime.block_on(async move {
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(10).connect_lazy_with(server_options());
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                amount numeric NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await?;
        let app = if mode == "guarded" {
            let one_transaction = std::env::var("IDEMPOTENCY_ONE_TRANSACTION").as_deref() == Ok("on");
            Router::new().route("/payments", post(pay_guarded)).layer(IdempotencyLayer::new(pool).one_transaction(one_transaction))
        } else {
            Router::new().route("/payments", post(pay_plain)).with_state(pool)
        };
        listen(app).await
    });
    if let Err(err) = result {
        fail(format!("the {} server: {}", mode, err));
    }
}

/// DATABASE_URL, or through the proxy when BENCH_PROXY_PORT says so.
fn server_options() -> PgConnectOptions {
    let options = database_options();
    match std::env::var(PROXY_PORT) {
        // The user and database of DATABASE_URL (a password comes from PGPASSWORD).
        Ok(port) => PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port.parse().unwrap_or_else(|_| fail("a bad proxy port")))
            .username(options.get_username())
            .database(options.get_database().unwrap_or(options.get_username()))
            .ssl_mode(PgSslMode::Disable),
        Err(_) => options,
    }
}

/// Serves `app` on a free port of 127.0.0.1, after printing the address.
async fn listen(app: Router) -> Result<(), Box<dyn Error + Send + Sync>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await?;
    Ok(())
}

/// The guarded route: charges in the layer's transaction.
async fn pay_guarded(tx: Tx, body: Bytes) -> Response<Body> {
    match tx.lock().await {
        Ok(mut db) => charge(&mut db, &body).await,
        Err(err) => answer(500, err.to_string()),
    }
}

/// The plain route: charges in a transaction of its own (BEGIN ... COMMIT).
async fn pay_plain(axum::extract::State(pool): axum::extract::State<PgPool>, body: Bytes) -> Response<Body> {
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(err) => return answer(503, err.to_string()),
    };
    let response = charge(&mut tx, &body).await;
    if response.status() != 201 {
        return response; // the transaction rolls back when dropped
    }
    match tx.commit().await {
        Ok(()) => response,
        Err(err) => answer(500, err.to_string()),
    }
}

/// Inserts the charge of `body` through `db`; answers 201 `{"charge": id}`.
async fn charge(db: &mut PgConnection, body: &[u8]) -> Response<Body> {
    let amount = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(payment) if payment["amount"].as_f64().is_some_and(|amount| amount > 0.0) => payment["amount"].to_string(),
        _ => return answer(400, "amount must be a positive number".into()),
    };
    let sql = "INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id";
    match sqlx::query_scalar::<_, i64>(sql).bind(amount).fetch_one(db).await {
        Ok(id) => {
            let mut response = answer(201, format!("{{\"charge\":{id}}}"));
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
