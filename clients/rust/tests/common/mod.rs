//! Shared by the test files: the database (DATABASE_URL, where
//! `CREATE EXTENSION idempotency` is done), a hyper server wrapped in the
//! layer on 127.0.0.1, and a raw HTTP/1.1 client that sends exactly what a
//! test says (a field twice, a malformed key).
#![allow(dead_code)] // each test file uses part of this

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::service::{make_service_fn, service_fn};
use hyper::{Body, Request, Response, Server};
use pg_idempotency::tokio_postgres::{Client, Config, NoTls};
use pg_idempotency::{IdempotencyLayer, Pool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::Layer;

/// The connection settings of the test database.
pub fn config() -> Config {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL: a database with CREATE EXTENSION idempotency");
    url.parse().expect("DATABASE_URL is a PostgreSQL URL")
}

/// A connection of its own to the test database.
pub async fn connect() -> Client {
    connect_with(config()).await
}

/// A connection with these settings.
pub async fn connect_with(config: Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("the test database answers");
    tokio::spawn(connection);
    client
}

/// A pool on the test database.
pub fn pool() -> Pool {
    Pool::new(config(), NoTls, 8)
}

/// A pool whose connections start with these server options (`-c name=value`).
pub fn pool_with_options(options: &str) -> Pool {
    let mut config = config();
    config.options(options);
    Pool::new(config, NoTls, 8)
}

/// A name no other test (or earlier run) uses: for keys and tables.
pub fn unique(name: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{}_{}", name, nanos)
}

/// Creates a table `name (id bigint identity, note text)` for a test's business writes.
pub async fn create_table(db: &Client, name: &str) {
    let sql = format!("CREATE TABLE {} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)", name);
    db.batch_execute(&sql).await.unwrap();
}

/// Counts the rows of a table.
pub async fn count_rows(db: &Client, table: &str) -> i64 {
    db.query_one(&format!("SELECT count(*) FROM {}", table) as &str, &[]).await.unwrap().get(0)
}

/// Serves `handler` behind `layer` on a free port of 127.0.0.1, for as long
/// as the test's runtime lives; returns the address.
pub async fn serve<H, F>(layer: IdempotencyLayer, handler: H) -> SocketAddr
where
    H: Fn(Request<Body>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let service = layer.layer(service_fn(move |request| {
        let response = handler(request);
        async move { Ok::<_, Infallible>(response.await) }
    }));
    let make_service = make_service_fn(move |_| {
        let service = service.clone();
        async move { Ok::<_, Infallible>(service) }
    });
    let server = Server::bind(&SocketAddr::from(([127, 0, 0, 1], 0))).serve(make_service);
    let address = server.local_addr();
    tokio::spawn(server);
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
            assert!(problem[member].as_str().map_or(false, |s| !s.is_empty()), "{}", problem);
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
        request.push_str(&format!("{}: {}\r\n", name, value));
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
    let body = raw[head_len..].to_vec();
    let reply = Reply { status: response.code.unwrap(), headers, body };
    if let Some(length) = reply.header("content-length") {
        assert_eq!(length.parse::<usize>().unwrap(), reply.body.len(), "the body has its Content-Length");
    }
    reply
}
