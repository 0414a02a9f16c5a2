//! What the layer costs per request: database round trips and latency of a
//! fresh request and of a replay, against the same route without the layer
//! and under the hand-written recipe, in both of the layer's modes.
//! Not a test (`cargo test` does not build it); run it with
//!
//!     DATABASE_URL=... clients/rust/bench/overhead [REQUESTS]
//!
//! The payment route (insert a charge, answer 201 `{"charge": id}`) is
//! served six times by axum, each in a process of its own on 127.0.0.1:
//! "guarded", behind `IdempotencyLayer`, writing through its `Tx`; "one",
//! the same in the layer's one-transaction mode; "guarded+prepare" and
//! "one+prepare", the same with the layer's `prepare(true)`; "recipe", under the
//! hand-written recipe (`recipe` below: no idempotency library); and
//! "plain", in a transaction of its own per request (`pool.begin()`,
//! insert, `commit()`), each on the same kind of `PgPool` (SQLx's
//! defaults, 10 connections). One client sends REQUESTS (default 2000)
//! sequential requests of each kind (plain; a fresh key and a replayed key
//! to each of the others) over one kept-alive connection per server. The
//! kinds take turns, 100 timed requests at a time after 20 untimed, so that
//! other load on the machine weighs on each alike; it prints the median and
//! 90th percentile, and the speed of each mode against the recipe (the
//! recipe's median over the mode's: above 1.0x, the layer is faster). The
//! recipe's statements are SQLx's default, prepared once per connection;
//! RECIPE_UNNAMED=on sends them unnamed, parsed and planned on every call,
//! as the layer sends its own (so that it works through a transaction pooler).
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
use axum::extract::State;
use axum::http::{HeaderMap, Method, Response, Uri};
use axum::routing::post;
use axum::serve::ListenerExt;
use pg_idempotency::{IdempotencyLayer, Tx};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sha2::{Digest, Sha256};
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
    println!(
        "{} sequential requests of each kind, latency in µs \
         (guarded: two transactions; one: one transaction; recipe: hand-written):",
        requests / BATCH * BATCH
    );
    println!("{:<15}{:>8}{:>8}{:>13}{:>8}", "request", "median", "p90", "round trips", "closes");
    let mut medians = Vec::new();
    for ((name, mut latencies), (trips, closes)) in KINDS.iter().zip(latencies).zip(trips) {
        latencies.sort();
        medians.push(micros(quantile(&latencies, 0.5)));
        println!(
            "{:<15}{:>8.0}{:>8.0}{:>13.1}{:>8.1}",
            name,
            medians[medians.len() - 1],
            micros(quantile(&latencies, 0.9)),
            trips,
            closes
        );
    }
    println!("\nours ÷ hand-written (the recipe's median over ours; above 1.0x ours is faster):");
    println!("{:<28}{:>8}{:>8}", "mode", "fresh", "replay");
    let recipe = KINDS.len() - 2;
    for (mode, first) in [
        ("two transactions", 1),
        ("one transaction", 3),
        ("two transactions, prepare", 5),
        ("one transaction, prepare", 7),
    ] {
        println!("{:<28}{:>7.2}x{:>7.2}x", mode, medians[recipe] / medians[first], medians[recipe + 1] / medians[first + 1]);
    }
}

/// The kinds of request, in the order they take turns.
const KINDS: [&str; 11] = [
    "plain",
    "fresh",
    "replay",
    "one fresh",
    "one replay",
    "prep fresh",
    "prep replay",
    "one prep fresh",
    "one prep replay",
    "recipe fresh",
    "recipe replay",
];

/// The servers' modes: kind 0 goes to the first, kinds 1 and 2 to the
/// second, and so on. "+prepare": the layer's `prepare(true)`.
const MODES: [&str; 6] = ["plain", "guarded", "one", "guarded+prepare", "one+prepare", "recipe"];

/// The server and the Idempotency-Key of request `i` of kind `kind` (an index of KINDS).
fn request_of(kind: usize, i: usize, run: u128, servers: &mut [BenchServer]) -> (&mut BenchServer, Option<String>) {
    let server = &mut servers[kind.div_ceil(2)];
    match kind {
        0 => (server, None),
        _ if kind % 2 == 1 => (server, Some(format!("fresh-{}-{}", run, i))),
        _ => (server, Some(format!("replay-{}-{}", kind, run))),
    }
}

/// Starts a server of each mode (through the proxy on `proxy`, if any).
fn start_servers(proxy: Option<u16>) -> Vec<BenchServer> {
    MODES.iter().map(|mode| BenchServer::start(mode, proxy)).collect()
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
    let mut sent = 0;
    for kind in 0..KINDS.len() {
        let mut before = (0, 0);
        for i in 0..10 + COUNTED {
            if i == 10 {
                before = counts.read();
            }
            // Numbered across kinds: a fresh key of one mode is no other's.
            sent += 1;
            let (server, key) = request_of(kind, sent, run, &mut servers);
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

/// Serves the payment route of `mode` (one of MODES) on 127.0.0.1,
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
        sqlx::raw_sql(RECIPE_TABLE).execute(&pool).await?;
        let app = match mode {
            "guarded" | "one" | "guarded+prepare" | "one+prepare" => Router::new()
                .route("/payments", post(pay_guarded))
                .layer(IdempotencyLayer::new(pool).one_transaction(mode.starts_with("one")).prepare(mode.ends_with("+prepare"))),
            "recipe" => Router::new().route("/payments", post(pay_recipe)).with_state(pool),
            _ => Router::new().route("/payments", post(pay_plain)).with_state(pool),
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
    let (status, body) = payment(db, body).await;
    json_answer(status, body.into_bytes())
}

/// Inserts the charge of `body` through `db`; returns the answer's status and body.
async fn payment(db: &mut PgConnection, body: &[u8]) -> (u16, String) {
    let amount = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(payment) if payment["amount"].as_f64().is_some_and(|amount| amount > 0.0) => payment["amount"].to_string(),
        _ => return (400, "amount must be a positive number".into()),
    };
    let sql = "INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id";
    match sqlx::query_scalar::<_, i64>(sql).bind(amount).fetch_one(db).await {
        Ok(id) => (201, format!("{{\"charge\":{id}}}")),
        Err(err) => (500, err.to_string()),
    }
}

/// A response of `status` with a JSON `body`.
fn json_answer(status: u16, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("a valid response")
}

// The hand-written recipe, with no idempotency library: what a careful team
// writes with SQLx before it reaches for one. In one transaction, INSERT ...
// ON CONFLICT DO NOTHING claims (scope, key) in a table of its own; when it
// inserted, the route's work and the UPDATE that stores the response; when
// it did not (the key committed before, or a concurrent duplicate waited on
// the unique index until it did), the SELECT of the stored response:
// replayed when the request hash is the same, else 422. Scoped per caller (a
// hash of the credential). An error or a 5xx rolls the claim back with the
// work (the transaction rolls back when dropped), so that a retry runs
// again; so does a crash.
const RECIPE_TABLE: &str = "CREATE TABLE IF NOT EXISTS recipe_keys (
    scope text NOT NULL, key text NOT NULL, request_hash bytea NOT NULL,
    status text NOT NULL DEFAULT 'started', response_code int, response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))";
const RECIPE_CLAIM: &str = "INSERT INTO recipe_keys (scope, key, request_hash) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const RECIPE_STORED: &str =
    "SELECT request_hash, status, response_code, response_body FROM recipe_keys WHERE scope = $1 AND key = $2";
const RECIPE_STORE: &str =
    "UPDATE recipe_keys SET status = 'completed', response_code = $3, response_body = $4 WHERE scope = $1 AND key = $2";

/// The recipe's route: charges under the recipe.
async fn pay_recipe(State(pool): State<PgPool>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response<Body> {
    let key = match headers.get("idempotency-key").and_then(|value| value.to_str().ok()) {
        Some(key) if !key.is_empty() && key.len() <= 255 => key,
        _ => return answer(400, "Idempotency-Key required".into()),
    };
    let credential = headers.get("authorization").map(|value| value.as_bytes()).unwrap_or_default();
    let scope = hex::encode(Sha256::digest(credential));
    let request_hash = Sha256::new().chain_update(format!("{} {}\n", method, uri.path())).chain_update(&body).finalize().to_vec();
    recipe(&pool, &scope, key, &request_hash, &body).await.unwrap_or_else(|err| answer(500, err.to_string()))
}

/// Whether the recipe's statements are prepared once per connection (SQLx's default): RECIPE_UNNAMED.
static PREPARED: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("RECIPE_UNNAMED").as_deref() != Ok("on"));

/// The recipe for one request: the stored answer, or the charge's, stored.
async fn recipe(pool: &PgPool, scope: &str, key: &str, request_hash: &[u8], body: &[u8]) -> sqlx::Result<Response<Body>> {
    let mut tx = pool.begin().await?;
    let claimed = sqlx::query(RECIPE_CLAIM).persistent(*PREPARED).bind(scope).bind(key).bind(request_hash).execute(&mut *tx).await?;
    if claimed.rows_affected() == 0 {
        let (stored_hash, status, code, stored): (Vec<u8>, String, Option<i32>, Option<Vec<u8>>) =
            sqlx::query_as(RECIPE_STORED).persistent(*PREPARED).bind(scope).bind(key).fetch_one(&mut *tx).await?;
        tx.commit().await?;
        return Ok(match (code, stored) {
            _ if stored_hash != request_hash => answer(422, "key reused".into()),
            (Some(code), Some(stored)) if status == "completed" => {
                let mut response = json_answer(code as u16, stored);
                response.headers_mut().insert("idempotent-replayed", "true".parse().expect("a header value"));
                response
            }
            _ => answer(409, "in progress".into()),
        });
    }
    let (status, answer) = payment(&mut tx, body).await;
    if status < 500 {
        sqlx::query(RECIPE_STORE).persistent(*PREPARED).bind(scope).bind(key).bind(status as i32).bind(answer.as_bytes()).execute(&mut *tx).await?;
        tx.commit().await?;
    }
    Ok(json_answer(status, answer.into_bytes()))
}

/// A response of `status` with `body`.
fn answer(status: u16, body: String) -> Response<Body> {
    Response::builder().status(status).body(Body::from(body)).expect("a valid response")
}
