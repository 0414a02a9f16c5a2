//! The layer composed with the tower-http layers and the authentication
//! that applications put around it, in the orders users write them (the
//! README's table "Composing it with other layers"), over real HTTP on
//! 127.0.0.1 against the database.

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Reply, connect, count_rows, create_table, pool, pool_with, pool_with_settings, options, post as post_key, serve_router, unique};
use pg_idempotency::{Error, IdempotencyLayer, Tx, lookup};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use tower_http::validate_request::ValidateRequestHeaderLayer;

/// What a test's handler does on its first run, after its insert (later runs only charge).
#[derive(Clone, Copy)]
enum FirstRun {
    Charge,
    Stall,
    Panic,
}

/// Inserts a row in `table` in the request's transaction; returns its id.
async fn insert(tx: &Tx, table: &str) -> Result<i64, Error> {
    let mut db = tx.lock().await?;
    let sql = format!("INSERT INTO {table} (note) VALUES ('charged') RETURNING id");
    Ok(sqlx::query_scalar(&sql).fetch_one(&mut *db).await?)
}

/// POST /payments: charges in the request's transaction, then stalls or
/// panics on its first run as told; answers 201 with the charge's id (and
/// enough bytes for a compression layer to compress).
fn payments(table: &str, runs: &Arc<AtomicUsize>, first: FirstRun) -> Router {
    let (table, runs) = (table.to_owned(), runs.clone());
    let handler = move |tx: Tx| {
        let (table, runs) = (table.clone(), runs.clone());
        async move {
            let run = runs.fetch_add(1, SeqCst);
            let id = insert(&tx, &table).await?;
            match first {
                _ if run > 0 => {}
                FirstRun::Charge => {}
                FirstRun::Stall => tokio::time::sleep(Duration::from_secs(30)).await,
                FirstRun::Panic => panic!("the handler panics after its insert (this panic is expected)"),
            }
            let body = format!("{{\"charge\":{id},\"note\":\"{}\"}}", "paid ".repeat(20));
            Ok::<_, Error>((StatusCode::CREATED, [("content-type", "application/json")], body))
        }
    };
    Router::new().route("/payments", post(handler))
}

/// A table of its own and a run counter.
async fn table_and_counter(name: &str) -> (String, Arc<AtomicUsize>) {
    let table = unique(name);
    create_table(&connect().await, &table).await;
    (table, Arc::new(AtomicUsize::new(0)))
}

/// tower-http's timeout, answering 408 after 3 s: the stalled first run
/// always outlasts it, a retry's run on a loaded machine does not.
fn timeout() -> TimeoutLayer {
    TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_secs(3))
}

/// Waits (bounded) until the record of `key` (unscoped) is gone: the key was freed.
async fn wait_until_freed(key: &str) {
    let db = connect().await;
    for _ in 0..200 {
        if lookup(&db, key, Some("")).await.unwrap().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("key {key} was not freed");
}

/// Serves the payment route of a table of its own, wrapped by `stack`
/// (which adds the layers); returns its address, table and run counter.
async fn serve_payments(name: &str, first: FirstRun, stack: impl FnOnce(Router) -> Router) -> (SocketAddr, String, Arc<AtomicUsize>) {
    let (table, runs) = table_and_counter(name).await;
    let address = serve_router(stack(payments(&table, &runs, first))).await;
    (address, table, runs)
}

/// Sends a first request, which a layer around the handler answers with
/// `status`, and asserts that nothing of it was kept: its key freed, its
/// charge rolled back, and a retry runs again.
async fn assert_nothing_kept(address: SocketAddr, table: &str, runs: &Arc<AtomicUsize>, status: u16) {
    let key = unique("k");
    let first = post_key(address, &key, b"{}", &[]).await;
    assert_eq!(first.status, status, "{first:?}");
    wait_until_freed(&key).await;
    assert_retry_runs_again(address, &key, table, runs).await;
}

/// Asserts that the first request's work is gone and that a retry runs again and then replays.
async fn assert_retry_runs_again(address: SocketAddr, key: &str, table: &str, runs: &Arc<AtomicUsize>) {
    let db = connect().await;
    assert_eq!(count_rows(&db, table).await, 0, "the first run's charge rolled back");
    let retry = post_key(address, key, b"{}", &[]).await;
    assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, None), "{retry:?}");
    assert_eq!(runs.load(SeqCst), 2, "the retry ran the handler again");
    let again = post_key(address, key, b"{}", &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed"), &again.body), (201, Some("true"), &retry.body));
    assert_eq!(count_rows(&db, table).await, 1);
}

#[tokio::test]
async fn a_timeout_inside_the_layer_rolls_back_frees_the_key_and_is_not_stored() {
    let stack = ServiceBuilder::new().layer(IdempotencyLayer::new(pool())).layer(timeout());
    let (address, table, runs) = serve_payments("timeout_in", FirstRun::Stall, |app| app.layer(stack)).await;
    assert_nothing_kept(address, &table, &runs, 408).await;
}

#[tokio::test]
async fn a_timeout_inside_the_layer_in_router_order_is_not_stored_either() {
    // Router::layer calls: the last one is the outermost.
    let stack = |app: Router| app.layer(timeout()).layer(IdempotencyLayer::new(pool()));
    let (address, table, runs) = serve_payments("timeout_in_router", FirstRun::Stall, stack).await;
    assert_nothing_kept(address, &table, &runs, 408).await;
}

#[tokio::test]
async fn a_timeout_of_a_handler_without_a_transaction_is_not_stored() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            if runs.fetch_add(1, SeqCst) == 0 {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            StatusCode::CREATED
        }
    };
    let app = Router::new().route("/payments", post(handler)).layer(timeout()).layer(IdempotencyLayer::new(pool()));
    let address = serve_router(app).await;
    let key = unique("k");
    assert_eq!(post_key(address, &key, b"{}", &[]).await.status, 408);
    assert!(lookup(&connect().await, &key, Some("")).await.unwrap().is_none(), "no 408 stored");
    assert_eq!(post_key(address, &key, b"{}", &[]).await.status, 201);
}

#[tokio::test]
async fn a_timeout_outside_the_layer_rolls_back_and_frees_the_key() {
    let stack = ServiceBuilder::new().layer(timeout()).layer(IdempotencyLayer::new(pool()));
    let (address, table, runs) = serve_payments("timeout_out", FirstRun::Stall, |app| app.layer(stack)).await;
    assert_nothing_kept(address, &table, &runs, 408).await;
}

#[tokio::test]
async fn a_panic_caught_inside_the_layer_is_never_stored() {
    // Even with 5xx kept: a panic handler's 500 is not the handler's answer.
    let layer = IdempotencyLayer::new(pool_with_settings(&[("idempotency.store_server_errors", "on")]));
    let stack = ServiceBuilder::new().layer(layer).layer(CatchPanicLayer::new());
    let (address, table, runs) = serve_payments("panic_in", FirstRun::Panic, |app| app.layer(stack)).await;
    assert_nothing_kept(address, &table, &runs, 500).await;
}

#[tokio::test]
async fn a_panic_caught_outside_the_layer_rolls_back_and_frees_the_key() {
    let stack = ServiceBuilder::new().layer(CatchPanicLayer::new()).layer(IdempotencyLayer::new(pool()));
    let (address, table, runs) = serve_payments("panic_out", FirstRun::Panic, |app| app.layer(stack)).await;
    assert_nothing_kept(address, &table, &runs, 500).await;
}

#[tokio::test]
async fn a_body_limit_outside_the_layer_composes_in_one_service_builder() {
    let stack = ServiceBuilder::new().layer(RequestBodyLimitLayer::new(64)).layer(IdempotencyLayer::new(pool()));
    let (address, _, runs) = serve_payments("limit", FirstRun::Charge, |app| app.layer(stack)).await;
    assert_eq!(post_key(address, &unique("k"), &[b'x'; 65], &[]).await.status, 413);
    assert_eq!(runs.load(SeqCst), 0);
    let key = unique("k");
    let first = post_key(address, &key, &[b'x'; 64], &[]).await;
    assert_eq!(first.status, 201);
    let again = post_key(address, &key, &[b'x'; 64], &[]).await;
    assert_eq!((again.header("idempotent-replayed"), &again.body), (Some("true"), &first.body));
}

/// Gunzips a body.
fn gunzip(body: &[u8]) -> Vec<u8> {
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(body).read_to_end(&mut plain).expect("a gzip body");
    plain
}

/// POSTs with `Accept-Encoding: gzip`.
async fn post_gzip(address: SocketAddr, key: &str) -> Reply {
    post_key(address, key, b"{}", &[("Accept-Encoding", "gzip")]).await
}

#[tokio::test]
async fn compression_outside_the_layer_compresses_replays_too() {
    let stack = ServiceBuilder::new().layer(CompressionLayer::new()).layer(IdempotencyLayer::new(pool()));
    let (address, _, runs) = serve_payments("gzip_out", FirstRun::Charge, |app| app.layer(stack)).await;
    let key = unique("k");
    let first = post_gzip(address, &key).await;
    assert_eq!((first.status, first.header("content-encoding")), (201, Some("gzip")), "{first:?}");
    let again = post_gzip(address, &key).await;
    assert_eq!((again.header("content-encoding"), again.header("idempotent-replayed")), (Some("gzip"), Some("true")));
    assert_eq!(gunzip(&again.body), gunzip(&first.body));
    let plain = post_key(address, &key, b"{}", &[]).await;
    assert_eq!((plain.header("content-encoding"), &plain.body), (None, &gunzip(&first.body)), "negotiated per request");
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn compression_inside_the_layer_stores_the_encoding_with_the_body() {
    let stack = ServiceBuilder::new().layer(IdempotencyLayer::new(pool())).layer(CompressionLayer::new());
    let (address, _, runs) = serve_payments("gzip_in", FirstRun::Charge, |app| app.layer(stack)).await;
    let key = unique("k");
    let first = post_gzip(address, &key).await;
    assert_eq!((first.status, first.header("content-encoding")), (201, Some("gzip")), "{first:?}");
    let again = post_gzip(address, &key).await;
    assert_eq!((again.header("content-encoding"), again.header("idempotent-replayed")), (Some("gzip"), Some("true")));
    assert_eq!(again.body, first.body, "byte for byte, and labelled as what it is");
    assert!(gunzip(&again.body).starts_with(b"{\"charge\":"));
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn tracing_composes_in_either_order() {
    let (table, runs) = table_and_counter("trace").await;
    let outside = ServiceBuilder::new().layer(TraceLayer::new_for_http()).layer(IdempotencyLayer::new(pool()));
    let inside = ServiceBuilder::new().layer(IdempotencyLayer::new(pool())).layer(TraceLayer::new_for_http());
    for app in [payments(&table, &runs, FirstRun::Charge).layer(outside), payments(&table, &runs, FirstRun::Charge).layer(inside)] {
        let address = serve_router(app).await;
        let key = unique("k");
        let first = post_key(address, &key, b"{}", &[]).await;
        assert_eq!(first.status, 201);
        assert_eq!(post_key(address, &key, b"{}", &[]).await.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(runs.load(SeqCst), 2);
}

/// The authenticated caller, as an authentication layer leaves it in the request's extensions.
#[derive(Clone)]
struct Principal(String);

/// An authentication middleware: a known bearer token (an OAuth access
/// token, refreshed now and then) names its account; anything else is 401.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let token = request.headers().get("authorization").and_then(|value| value.to_str().ok()).unwrap_or("");
    let account = match token {
        "Bearer at_alice_1" | "Bearer at_alice_2" => "acct_alice",
        "Bearer at_bob_1" => "acct_bob",
        _ => return StatusCode::UNAUTHORIZED.into_response(),
    };
    request.extensions_mut().insert(Principal(account.into()));
    next.run(request).await
}

/// The scope of a request: the account its authentication found.
fn principal_scope(request: &axum::http::request::Parts) -> String {
    request.extensions.get::<Principal>().map(|principal| principal.0.clone()).unwrap_or_default()
}

#[tokio::test]
async fn with_the_scope_from_the_principal_a_refreshed_token_replays() {
    let stack = ServiceBuilder::new().layer(from_fn(authenticate)).layer(IdempotencyLayer::new(pool()).scope(principal_scope));
    let (address, _, runs) = serve_payments("principal", FirstRun::Charge, |app| app.layer(stack)).await;
    let key = unique("k");
    let first = post_key(address, &key, b"{}", &[("Authorization", "Bearer at_alice_1")]).await;
    assert_eq!(first.status, 201);
    let refreshed = post_key(address, &key, b"{}", &[("Authorization", "Bearer at_alice_2")]).await;
    assert_eq!((refreshed.header("idempotent-replayed"), &refreshed.body), (Some("true"), &first.body));
    let bob = post_key(address, &key, b"{}", &[("Authorization", "Bearer at_bob_1")]).await;
    assert_eq!((bob.status, bob.header("idempotent-replayed")), (201, None), "another account's key never meets");
    assert_eq!(post_key(address, &key, b"{}", &[]).await.status, 401);
    assert_eq!(runs.load(SeqCst), 2);
    assert!(lookup(&connect().await, &key, Some("acct_alice")).await.unwrap().is_some());
}

#[tokio::test]
async fn with_the_default_scope_a_refreshed_token_runs_again() {
    // What the README warns of: the default scope is a hash of the credential.
    let stack = ServiceBuilder::new().layer(from_fn(authenticate)).layer(IdempotencyLayer::new(pool()));
    let (address, _, runs) = serve_payments("refresh", FirstRun::Charge, |app| app.layer(stack)).await;
    let key = unique("k");
    for token in ["Bearer at_alice_1", "Bearer at_alice_2"] {
        let reply = post_key(address, &key, b"{}", &[("Authorization", token)]).await;
        assert_eq!((reply.status, reply.header("idempotent-replayed")), (201, None));
    }
    assert_eq!(runs.load(SeqCst), 2);
}

#[tokio::test]
async fn a_bearer_check_outside_the_layer_refuses_before_any_claim() {
    #[allow(deprecated)] // "too basic for real applications": a fixed token is what this test needs
    let auth = ValidateRequestHeaderLayer::bearer("at_alice_1");
    let stack = ServiceBuilder::new().layer(auth).layer(IdempotencyLayer::new(pool()));
    let (address, _, runs) = serve_payments("bearer", FirstRun::Charge, |app| app.layer(stack)).await;
    let key = unique("k");
    assert_eq!(post_key(address, &key, b"{}", &[("Authorization", "Bearer wrong")]).await.status, 401);
    let db = connect().await;
    assert_eq!(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency.keys WHERE key = $1").bind(&key).fetch_one(&db).await.unwrap(), 0);
    assert_eq!(post_key(address, &key, b"{}", &[("Authorization", "Bearer at_alice_1")]).await.status, 201);
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_handler_holds_no_connection_until_it_takes_its_transaction() {
    // One connection: the claims of other requests get it while a handler
    // calls a slow provider before it writes.
    let (table, runs) = table_and_counter("lazy").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options());
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (table, runs, started) = (table.clone(), runs.clone(), started.clone());
        move |tx: Tx| async move {
            runs.fetch_add(1, SeqCst);
            started.notify_one();
            tokio::time::sleep(Duration::from_secs(5)).await; // the provider's call
            let id = insert(&tx, &table).await?;
            Ok::<_, Error>((StatusCode::CREATED, format!("{{\"charge\":{id}}}")))
        }
    };
    let app = Router::new().route("/payments", post(handler)).layer(IdempotencyLayer::new(pool));
    let address = serve_router(app).await;
    let first = tokio::spawn(async move { post_key(address, &unique("k"), b"{}", &[]).await });
    tokio::time::timeout(Duration::from_secs(10), started.notified()).await.expect("the first handler starts");
    let second = post_key(address, &unique("k"), b"{}", &[]).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(count_rows(&connect().await, &table).await, 2);
}

#[tokio::test]
async fn errors_of_the_crate_answer_problems() {
    // Tx on a route without the layer: a problem, not a plain-text 500.
    let unguarded = Router::new().route("/payments", post(|_: Tx| async { StatusCode::CREATED }));
    let address = serve_router(unguarded).await;
    post_key(address, "k", b"{}", &[]).await.assert_problem(500, "idempotency_error");

    // A database error returned with `?`: 503, its work rolled back, the key freed.
    let (table, _) = table_and_counter("errors").await;
    let failing = move |tx: Tx| {
        let table = table.clone();
        async move {
            insert(&tx, &table).await?;
            sqlx::query("SELECT 1 / 0").execute(&mut *tx.lock().await?).await.map_err(Error::from)?;
            Ok::<_, Error>(StatusCode::CREATED)
        }
    };
    let app = Router::new().route("/payments", post(failing)).layer(IdempotencyLayer::new(pool_with(options(), 2)));
    let address = serve_router(app).await;
    let key = unique("k");
    post_key(address, &key, b"{}", &[]).await.assert_problem(503, "idempotency_unavailable");
    assert!(lookup(&connect().await, &key, Some("")).await.unwrap().is_none());
}
