//! When the database's answer is lost (docs/http-contract.md, "When an
//! answer is lost"): the layer in an axum Router whose pool connects through
//! the project's fault proxy (examples/faultproxy, started here with node;
//! FAULTPROXY names its faultproxy.js), which lets the server answer a
//! claim or a COMMIT and then cuts the connection. Every fault is armed
//! before the request, or by the handler itself, never by timing.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use axum::body::Body;
use axum::http::{Request, Response};
use common::{connect, count_rows, create_table, options, pool_with, post, send, serve, unique};
use pg_idempotency::{IdempotencyLayer, State, Tx, lookup};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The fault proxy, in a child process that dies with the test.
struct FaultProxy {
    child: Child,
    listen: u16,
    control: SocketAddr,
}

impl FaultProxy {
    /// Starts a proxy to the test database.
    fn start() -> FaultProxy {
        let script = std::env::var("FAULTPROXY").expect("FAULTPROXY: the path of examples/faultproxy/faultproxy.js");
        let db = options();
        let target = format!("{}:{}", db.get_host(), db.get_port());
        let mut child = Command::new("node")
            .args([script.as_str(), "--target", &target])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("node runs the fault proxy");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let ports: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("the proxy said {line:?}"));
        let port = |name: &str| ports[name].as_u64().unwrap_or_else(|| panic!("no {name} port in {line:?}")) as u16;
        FaultProxy { listen: port("listen"), control: SocketAddr::from(([127, 0, 0, 1], port("control"))), child }
    }

    /// A pool of the application's kind whose connections go through the proxy.
    fn pool(&self) -> PgPool {
        pool_with(self.options(), 4)
    }

    /// The test database's settings, through the proxy.
    fn options(&self) -> PgConnectOptions {
        options().host("127.0.0.1").port(self.listen)
    }

    /// Sends a command (`/cut?...`, `/refuse?...`) to the proxy.
    async fn command(&self, path: &str) {
        let reply = send(self.control, "POST", path, &[], b"").await;
        assert_eq!(reply.status, 200, "the proxy refused {path}: {reply:?}");
    }

    /// How many connections the proxy has cut so far.
    async fn cuts(&self) -> u64 {
        let body = send(self.control, "GET", "/stats", &[], b"").await.body;
        // The proxy answers in chunks: the JSON object is inside the one chunk.
        let text = String::from_utf8_lossy(&body);
        let json = &text[text.find('{').expect("a JSON object")..=text.rfind('}').expect("a JSON object")];
        let stats: serde_json::Value = serde_json::from_str(json).unwrap();
        stats["cuts"].as_u64().unwrap_or_else(|| panic!("no cuts in {stats}"))
    }
}

impl Drop for FaultProxy {
    /// Stops the proxy.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Cuts the next claim's connection once the server has answered it.
const CUT_CLAIM: &str = "/cut?match=idempotency%5C.claim&scope=statement";
/// Cuts the connection once the server has answered the COMMIT of the transaction with complete.
const CUT_COMMIT: &str = "/cut?match=idempotency%5C.complete&scope=transaction";
/// Cuts the connection once the server has answered complete, before the COMMIT is sent.
const CUT_COMPLETE: &str = "/cut?match=idempotency%5C.complete&scope=statement";

/// A server behind the layer on the proxy's pool whose handler counts its
/// runs, charges a row of `table` in the request's transaction, then awaits
/// `also` and answers 201 `{"charge": id}`.
async fn charging<F>(layer: IdempotencyLayer, table: &str, runs: &Arc<AtomicUsize>, also: F) -> SocketAddr
where
    F: Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Clone + Send + Sync + 'static,
{
    let (table, runs) = (table.to_owned(), runs.clone());
    let handler = move |request: Request<Body>| {
        let (table, runs, also) = (table.clone(), runs.clone(), also.clone());
        let tx = request.extensions().get::<Tx>().cloned().expect("the layer lends a transaction");
        async move {
            runs.fetch_add(1, SeqCst);
            let id = common::charge(&tx, &table).await;
            also().await;
            Response::builder()
                .status(201)
                .header("content-type", "application/json")
                .body(Body::from(format!("{{\"charge\":{id}}}")))
                .unwrap()
        }
    };
    serve(layer, handler).await
}

/// Nothing more for the handler to do.
fn nothing() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async {})
}

/// A table of its own and a run counter.
async fn table_and_counter(name: &str) -> (String, Arc<AtomicUsize>) {
    let table = unique(name);
    create_table(&connect().await, &table).await;
    (table, Arc::new(AtomicUsize::new(0)))
}

/// Asserts that the record of `key` (unscoped) is completed.
async fn assert_completed(key: &str) {
    let record = lookup(&connect().await, key, Some("")).await.unwrap().expect("a record");
    assert_eq!(record.state, State::Completed, "{record:?}");
}

/// A request with key `key` to a charging server, after arming `fault`.
struct Faulted {
    address: SocketAddr,
    table: String,
    runs: Arc<AtomicUsize>,
    key: String,
    reply: common::Reply,
    _proxy: FaultProxy,
}

/// Sends one request with `fault` armed; asserts that the proxy cut once
/// and that the client got the handler's own 201. With `one_transaction`,
/// the claim is in the handler's transaction.
async fn one_fault(name: &str, fault: &str, one_transaction: bool) -> Faulted {
    let proxy = FaultProxy::start();
    let (table, runs) = table_and_counter(name).await;
    let layer = IdempotencyLayer::new(proxy.pool()).one_transaction(one_transaction);
    let address = charging(layer, &table, &runs, nothing).await;
    proxy.command(fault).await;
    let key = unique("k");
    let reply = post(address, &key, b"{}", &[]).await;
    assert_eq!(proxy.cuts().await, 1, "the proxy cut one answer ({fault})");
    assert_eq!((reply.status, reply.header("idempotent-replayed")), (201, None), "{reply:?}");
    assert_completed(&key).await;
    Faulted { address, table, runs, key, reply, _proxy: proxy }
}

#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_asked_again_and_the_handler_runs_once() {
    for one_transaction in [false, true] {
        let lost = one_fault("lost_claim", CUT_CLAIM, one_transaction).await;
        assert_eq!((lost.runs.load(SeqCst), count_rows(&connect().await, &lost.table).await), (1, 1));
    }
}

#[tokio::test]
async fn a_claim_lost_every_time_is_a_503_that_says_the_request_did_not_run() {
    let proxy = FaultProxy::start();
    let (table, runs) = table_and_counter("lost_claims").await;
    let address = charging(IdempotencyLayer::new(proxy.pool()), &table, &runs, nothing).await;
    proxy.command(&format!("{CUT_CLAIM}&times=4")).await;
    let reply = post(address, &unique("k"), b"{}", &[]).await;
    assert_eq!(proxy.cuts().await, 4, "each of the 4 claims lost its answer");
    reply.assert_problem(503, "idempotency_unavailable");
    assert!(reply.json()["detail"].as_str().unwrap().contains("did not run"), "{reply:?}");
    assert_eq!(runs.load(SeqCst), 0);
}

#[tokio::test]
async fn a_commit_whose_answer_was_lost_answers_the_handlers_response_once() {
    for one_transaction in [false, true] {
        commit_answer_lost(one_transaction).await;
    }
}

/// A COMMIT's answer lost: the handler's own response, once.
async fn commit_answer_lost(one_transaction: bool) {
    let lost = one_fault("lost_commit", CUT_COMMIT, one_transaction).await;
    let db = connect().await;
    let charged: i64 = sqlx::query_scalar(&format!("SELECT max(id) FROM {}", lost.table)).fetch_one(&db).await.unwrap();
    assert_eq!(lost.reply.json(), serde_json::json!({ "charge": charged }), "the committed charge's answer");
    assert_eq!((lost.runs.load(SeqCst), count_rows(&db, &lost.table).await), (1, 1), "it ran once");
    let again = post(lost.address, &lost.key, b"{}", &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, lost.reply.body);
}

#[tokio::test]
async fn a_connection_lost_before_the_commit_runs_the_handler_again() {
    for one_transaction in [false, true] {
        let lost = one_fault("lost_complete", CUT_COMPLETE, one_transaction).await;
        assert_eq!(lost.runs.load(SeqCst), 2, "the first run rolled back, so it ran again");
        assert_eq!(count_rows(&connect().await, &lost.table).await, 1, "one charge committed");
    }
}

#[tokio::test]
async fn a_commit_lost_with_no_claim_to_tell_is_a_503_that_does_not_say_nothing_ran() {
    let proxy = Arc::new(FaultProxy::start());
    let (table, runs) = table_and_counter("lost_all").await;
    // The handler runs after the claim: from then on no new connection gets
    // through, and the pool's only connection is the one the COMMIT's cut closes.
    let also = {
        let proxy = proxy.clone();
        move || -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
            let proxy = proxy.clone();
            Box::pin(async move { proxy.command("/refuse?ms=600000").await })
        }
    };
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy_with(proxy.options());
    let address = charging(IdempotencyLayer::new(pool), &table, &runs, also).await;
    proxy.command(CUT_COMMIT).await;
    let key = unique("k");
    let reply = post(address, &key, b"{}", &[]).await;
    assert_eq!(proxy.cuts().await, 1, "the COMMIT's answer was lost");
    reply.assert_problem(503, "idempotency_unavailable");
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("may have completed") && !detail.contains("did not run"), "{detail}");
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (1, 1), "it did run, once");
    assert_completed(&key).await; // a retry with the key replays it
}

/// The idempotent function on the proxy's pool with `fault` armed: returns
/// what it returned, how often its closure ran, and its table's rows.
async fn function_fault(fault: &str, one_transaction: bool) -> (i64, usize, i64) {
    let proxy = FaultProxy::start();
    let (table, runs) = table_and_counter("fn_fault").await;
    proxy.command(fault).await;
    let function = pg_idempotency::Function::new(proxy.pool()).one_transaction(one_transaction);
    let charged = function
        .run(&unique("fn"), &1, |work: pg_idempotency::Work| {
            let (table, runs) = (table.clone(), runs.clone());
            async move {
                runs.fetch_add(1, SeqCst);
                Ok::<_, String>(common::charge(work.tx(), &table).await)
            }
        })
        .await
        .unwrap();
    assert_eq!(proxy.cuts().await, 1, "the proxy cut one answer ({fault})");
    (charged, runs.load(SeqCst), count_rows(&connect().await, &table).await)
}

#[tokio::test]
async fn a_function_whose_commit_answer_is_lost_returns_what_committed() {
    for one_transaction in [true, false] {
        let (charged, runs, rows) = function_fault(CUT_COMMIT, one_transaction).await;
        assert_eq!((runs, rows), (1, 1), "one_transaction {one_transaction}: ran once, charged once");
        assert!(charged > 0);
    }
}

#[tokio::test]
async fn a_function_whose_connection_broke_before_commit_runs_again() {
    for one_transaction in [true, false] {
        let (_, runs, rows) = function_fault(CUT_COMPLETE, one_transaction).await;
        assert_eq!((runs, rows), (2, 1), "one_transaction {one_transaction}: ran again, charged once");
    }
}
