//! Shared by the test files: the database (DATABASE_URL, where
//! `CREATE EXTENSION idempotency` is done), an axum server wrapped in the
//! layer on 127.0.0.1, and a raw HTTP/1.1 client that sends exactly what a
//! test says (a field twice, a malformed key).
#![allow(dead_code)] // each test file uses part of this

use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response};
use pg_idempotency::IdempotencyLayer;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The connection settings of the test database.
pub fn options() -> PgConnectOptions {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL: a database with CREATE EXTENSION idempotency");
    PgConnectOptions::from_str(&url).expect("DATABASE_URL is a PostgreSQL URL")
}

/// A pool of the test's own on the test database.
pub fn pool() -> PgPool {
    pool_with(options(), 8)
}

/// A pool of at most `size` connections with these settings, connecting when first used.
pub fn pool_with(options: PgConnectOptions, size: u32) -> PgPool {
    PgPoolOptions::new().max_connections(size).acquire_timeout(Duration::from_secs(10)).connect_lazy_with(options)
}

/// A pool whose connections start with these settings.
pub fn pool_with_settings(settings: &[(&str, &str)]) -> PgPool {
    pool_with(options().options(settings.iter().copied()), 8)
}

/// The test's own view of the database (a pool: its connections hold no session state).
pub async fn connect() -> PgPool {
    pool_with(options(), 2)
}

/// One connection, for session settings.
pub async fn connect_one() -> PgConnection {
    PgConnection::connect_with(&options()).await.expect("the test database answers")
}

/// A name no other test (or earlier run) uses: for keys and tables.
pub fn unique(name: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{name}_{nanos}")
}

/// Creates a table `name (id bigint identity, note text)` for a test's business writes.
pub async fn create_table(db: &PgPool, name: &str) {
    let sql = format!("CREATE TABLE {name} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)");
    sqlx::raw_sql(&sql).execute(db).await.unwrap();
}

/// Counts the rows of a table.
pub async fn count_rows(db: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(db).await.unwrap()
}

/// Charges a row of `table` (see [`create_table`]) in the request's transaction; its id.
pub async fn charge(tx: &pg_idempotency::Tx, table: &str) -> i64 {
    let mut db = tx.lock().await.unwrap();
    let sql = format!("INSERT INTO {table} (note) VALUES ('charged') RETURNING id");
    sqlx::query_scalar(&sql).fetch_one(&mut *db).await.unwrap()
}

/// Serves `handler` (for every method and path) in an axum Router behind
/// `layer` on a free port of 127.0.0.1, for as long as the test's runtime
/// lives; returns the address.
pub async fn serve<H, F>(layer: IdempotencyLayer, handler: H) -> SocketAddr
where
    H: Fn(Request<Body>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    serve_router(Router::new().fallback(move |request: Request<Body>| handler(request)).layer(layer)).await
}

/// Serves `app` on a free port of 127.0.0.1 for as long as the test's runtime lives; returns the address.
pub async fn serve_router(app: Router) -> SocketAddr {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

/// A response as the raw client read it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {:?}", self))
    }

    /// Asserts that this is an RFC 9457 problem with this status and code.
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{:?}", self);
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "{:?}", self);
        let problem = self.json();
        assert_eq!(problem["code"], code, "{}", problem);
        assert_eq!(problem["status"], status, "{}", problem);
        assert_eq!(problem["type"], "about:blank", "{}", problem);
        for member in ["title", "detail"] {
            assert!(problem[member].as_str().is_some_and(|s| !s.is_empty()), "{}", problem);
        }
    }
}

/// Sends one request over a new connection and reads the whole response.
pub async fn send(address: SocketAddr, method: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut request = format!(
        "{} {} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
        method,
        target,
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        stream.write_all(body).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        raw
    };
    let raw = tokio::time::timeout(Duration::from_secs(30), exchange).await.expect("an answer within 30 s");
    parse_reply(&raw)
}

/// POSTs `body` with Idempotency-Key `key` (the field as sent) and more headers.
pub async fn post(address: SocketAddr, key: &str, body: &[u8], headers: &[(&str, &str)]) -> Reply {
    let mut all = vec![("Idempotency-Key", key)];
    all.extend_from_slice(headers);
    send(address, "POST", "/payments", &all, body).await
}

/// Parses a whole HTTP/1.1 response (its body delimited by Content-Length).
fn parse_reply(raw: &[u8]) -> Reply {
    let mut fields = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut fields);
    let head_len = match response.parse(raw).expect("an HTTP response") {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => panic!("a partial response: {:?}", String::from_utf8_lossy(raw)),
    };
    let headers: Vec<(String, String)> = response
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), String::from_utf8_lossy(h.value).into_owned()))
        .collect();
    let chunked = headers.iter().any(|(name, value)| name == "transfer-encoding" && value.contains("chunked"));
    let body = if chunked { dechunk(&raw[head_len..]) } else { raw[head_len..].to_vec() };
    let reply = Reply { status: response.code.unwrap(), headers, body };
    if let Some(length) = reply.header("content-length") {
        assert_eq!(length.parse::<usize>().unwrap(), reply.body.len(), "the body has its Content-Length");
    }
    reply
}

/// The data of a chunked body (RFC 9112 7.1), without extensions or trailers.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n").expect("a chunk size line");
        let size_field = String::from_utf8_lossy(&raw[..line_end]);
        let size = usize::from_str_radix(size_field.split(';').next().unwrap().trim(), 16).expect("a hex chunk size");
        raw = &raw[line_end + 2..];
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// Returns once another backend whose statement names `key` is in the
/// state `condition` (SQL on pg_stat_activity) says, polling (bounded).
pub async fn wait_for_backend(key: &str, condition: &str) {
    let db = connect().await;
    let sql = format!("SELECT count(*) FROM pg_stat_activity WHERE {condition} AND strpos(query, $1) > 0 AND pid <> pg_backend_pid()");
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(&sql).bind(key).fetch_one(&db).await.unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no statement of {key} came to {condition}");
}
