//! The layer in an axum 0.8 Router over real HTTP (127.0.0.1), one test per row of the
//! answers table of docs/http-contract.md, and then some.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, Response};
use common::{connect, count_rows, create_table, options, pool, pool_with, pool_with_settings, post, send, serve, unique};
use pg_idempotency::{ClaimOptions, IdempotencyLayer, Outcome, Owner, RequestBody, State, Tx, claim, credential_scope, fingerprint, lookup};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};

type Handled = Pin<Box<dyn Future<Output = Response<Body>> + Send>>;

/// The request's transaction, which the layer lends the handler.
fn tx_of(request: &Request<Body>) -> Tx {
    request.extensions().get::<Tx>().expect("the layer lends a transaction").clone()
}

/// Inserts a row in `table` through `tx`; returns its id.
async fn insert(tx: Tx, table: &str) -> i64 {
    let mut db = tx.lock().await.unwrap();
    let sql = format!("INSERT INTO {table} (note) VALUES ('charged') RETURNING id");
    sqlx::query_scalar(&sql).fetch_one(&mut *db).await.unwrap()
}

/// A response with this status and body, as JSON.
fn json_response(status: u16, body: String) -> Response<Body> {
    Response::builder().status(status).header("content-type", "application/json").body(Body::from(body)).unwrap()
}

/// A handler that counts its runs, inserts a row in `table` through the
/// request's transaction, waits `delay`, then answers what `respond` makes
/// of the row's id, the run's number (from 0) and the claim's [`Owner`].
fn inserting<R>(table: &str, runs: &Arc<AtomicUsize>, delay: Duration, respond: R) -> impl Fn(Request<Body>) -> Handled + Clone + use<R>
where
    R: Fn(i64, usize, Option<Owner>) -> Response<Body> + Clone + Send + Sync + 'static,
{
    let (table, runs) = (table.to_owned(), runs.clone());
    move |request| {
        let (table, runs, respond, tx) = (table.clone(), runs.clone(), respond.clone(), tx_of(&request));
        let owner = request.extensions().get::<Owner>().cloned();
        Box::pin(async move {
            let run = runs.fetch_add(1, SeqCst);
            let id = insert(tx, &table).await;
            tokio::time::sleep(delay).await;
            respond(id, run, owner)
        })
    }
}

/// A handler that inserts a charge, waits `delay`, then answers `status` with `{"charge": id}`.
fn charging(table: &str, runs: &Arc<AtomicUsize>, delay: Duration, status: u16) -> impl Fn(Request<Body>) -> Handled + Clone + use<> {
    inserting(table, runs, delay, move |id, _, _| json_response(status, format!("{{\"charge\":{}}}", id)))
}

/// A table of its own and a run counter, for a test's handler.
async fn table_and_counter(name: &str) -> (String, Arc<AtomicUsize>) {
    let table = unique(name);
    create_table(&connect().await, &table).await;
    (table, Arc::new(AtomicUsize::new(0)))
}

/// A table of its own, a run counter and a server with `layer` and a charging handler.
async fn charging_server(name: &str, layer: IdempotencyLayer, delay: Duration, status: u16) -> (std::net::SocketAddr, String, Arc<AtomicUsize>) {
    let (table, runs) = table_and_counter(name).await;
    let address = serve(layer, charging(&table, &runs, delay, status)).await;
    (address, table, runs)
}

#[tokio::test]
async fn the_first_request_runs_and_a_retry_replays_it_byte_for_byte() {
    let (table, runs) = table_and_counter("replay").await;
    let handler = inserting(&table, &runs, Duration::ZERO, |id, _, owner| {
        let mut body = vec![0u8, 0xff, b'\r', b'\n'];
        body.extend_from_slice(format!("{} attempt {}", id, owner.map_or(0, |o| o.attempt)).as_bytes());
        Response::builder()
            .status(201)
            .header("content-type", "application/octet-stream")
            .header("location", format!("/payments/{}", id))
            .header("x-not-stored", "1")
            .body(Body::from(body))
            .unwrap()
    });
    let address = serve(IdempotencyLayer::new(pool()), handler).await;
    let key = unique("k");
    let quoted = format!("\"{}\"", key);

    let first = post(address, &quoted, b"{\"amount\":10}", &[]).await;
    assert_eq!(first.status, 201);
    assert!(first.body.ends_with(b" attempt 1"), "the handler sees its Owner: {:?}", first);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("x-not-stored"), Some("1"));

    for field in [quoted.as_str(), &key, &format!(" \t{} ", quoted)] {
        let again = post(address, field, b"{\"amount\":10}", &[]).await;
        assert_eq!(again.status, 201, "{:?}", again);
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("content-type"), Some("application/octet-stream"));
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("x-not-stored"), None);
    }
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(count_rows(&connect().await, &table).await, 1);
}

#[tokio::test]
async fn a_retry_while_the_first_runs_is_409_with_retry_after() {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (started, gate) = (started.clone(), gate.clone());
        move |_: Request<Body>| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                json_response(201, "{}".into())
            }
        }
    };
    let address = serve(IdempotencyLayer::new(pool()).lease(Duration::from_secs(30)), handler).await;
    let key = unique("busy");
    let first = tokio::spawn({
        let key = key.clone();
        async move { post(address, &key, b"{}", &[]).await }
    });
    let started = tokio::time::timeout(Duration::from_secs(10), started.notified()).await;
    started.expect("the first request's handler starts");
    let busy = post(address, &key, b"{}", &[]).await;
    busy.assert_problem(409, "idempotency_key_in_progress");
    let retry_after: u32 = busy.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "{}", retry_after);
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(post(address, &key, b"{}", &[]).await.header("idempotent-replayed"), Some("true"));
}

#[tokio::test]
async fn the_same_key_with_another_request_is_422() {
    let (address, _, runs) = charging_server("mismatch", IdempotencyLayer::new(pool()), Duration::ZERO, 201).await;
    let key = unique("k");
    assert_eq!(post(address, &key, b"{\"amount\":10}", &[]).await.status, 201);
    post(address, &key, b"{\"amount\":99}", &[]).await.assert_problem(422, "idempotency_key_mismatch");
    let other_path = send(address, "POST", "/refunds", &[("Idempotency-Key", &key)], b"{\"amount\":10}").await;
    other_path.assert_problem(422, "idempotency_key_mismatch");
    let other_query = send(address, "POST", "/payments?x=1", &[("Idempotency-Key", &key)], b"{\"amount\":10}").await;
    other_query.assert_problem(422, "idempotency_key_mismatch");
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_400() {
    let (address, _, runs) = charging_server("badkey", IdempotencyLayer::new(pool()), Duration::ZERO, 201).await;
    send(address, "POST", "/payments", &[], b"{}").await.assert_problem(400, "idempotency_key_missing");
    let long = format!("\"{}\"", "k".repeat(256));
    for bad in ["\"unterminated", "\"abc\";x=1", "?1", ":YWJj:", "(a b)", "\"\"", "\"a\\qb\"", "\"a\", \"b\"", "a b", "", &long] {
        post(address, bad, b"{}", &[]).await.assert_problem(400, "idempotency_key_invalid");
    }
    let twice = send(address, "POST", "/payments", &[("Idempotency-Key", "\"a\""), ("Idempotency-Key", "\"a\"")], b"{}").await;
    twice.assert_problem(400, "idempotency_key_invalid");
    assert_eq!(runs.load(SeqCst), 0);
}

#[tokio::test]
async fn a_handler_that_loses_its_claim_gets_409_and_its_writes_roll_back() {
    let lease = Duration::from_millis(300);
    let layer = IdempotencyLayer::new(pool()).lease(lease);
    let (address, table, _) = charging_server("lost", layer, Duration::from_millis(1500), 201).await;
    let key = unique("lost");
    let first = tokio::spawn({
        let key = key.clone();
        async move { post(address, &key, b"{}", &[]).await }
    });
    let db = connect().await;
    wait_until_lease_ended(&db, &key).await;
    let retry = ClaimOptions { scope: Some(String::new()), ..ClaimOptions::default() };
    match claim(&db, &key, &fingerprint("POST", "/payments", Some(b"{}"), None), &retry).await.unwrap() {
        Outcome::New(owner) => assert_eq!(owner.attempt, 2),
        other => panic!("expected a takeover, got {:?}", other),
    }
    let lost = first.await.unwrap();
    lost.assert_problem(409, "idempotency_claim_lost");
    assert_eq!(lost.header("retry-after"), Some("1"));
    assert_eq!(count_rows(&db, &table).await, 0, "the handler's insert rolled back");
    let record = lookup(&db, &key, Some("")).await.unwrap().unwrap();
    assert_eq!((record.state, record.attempt), (State::InProgress, 2), "the takeover still owns the key");
}

/// Waits (bounded) until the lease of `key` (unscoped) has ended.
async fn wait_until_lease_ended(db: &PgPool, key: &str) {
    for _ in 0..100 {
        if let Some(record) = lookup(db, key, Some("")).await.unwrap() {
            if record.lease_expires_at.is_some_and(|end| end < std::time::SystemTime::now()) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the lease of {} did not end", key);
}

/// A pool on a port where no database listens.
fn unreachable_pool() -> PgPool {
    let options = PgConnectOptions::new().host("127.0.0.1").port(1).username("nobody").database("none");
    sqlx::postgres::PgPoolOptions::new().acquire_timeout(Duration::from_secs(2)).connect_lazy_with(options)
}

#[tokio::test]
async fn without_the_database_it_fails_closed_with_503() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |_: Request<Body>| {
            runs.fetch_add(1, SeqCst);
            async { json_response(201, "{}".into()) }
        }
    };
    let address = serve(IdempotencyLayer::new(unreachable_pool()), handler).await;
    let down = post(address, "\"k\"", b"{}", &[]).await;
    down.assert_problem(503, "idempotency_unavailable");
    assert_eq!(down.header("retry-after"), Some("1"));
    assert_eq!(runs.load(SeqCst), 0);
}

#[tokio::test]
async fn fail_open_runs_the_handler_without_the_database() {
    let handler = |request: Request<Body>| {
        let lent = request.extensions().get::<Tx>().is_some();
        async move { json_response(201, format!("{{\"tx\":{}}}", lent)) }
    };
    let address = serve(IdempotencyLayer::new(unreachable_pool()).fail_open(true), handler).await;
    let open = post(address, "\"k\"", b"{}", &[]).await;
    assert_eq!((open.status, open.json()), (201, serde_json::json!({"tx": false})));
}

/// A role that may write `table` but not use the extension, and a pool that logs in as it.
async fn role_without_the_extension(table: &str) -> PgPool {
    let role = unique("no_idem");
    let db = connect().await;
    sqlx::raw_sql(&format!("CREATE ROLE {role}; GRANT ALL ON TABLE {table} TO {role}")).execute(&db).await.unwrap();
    pool_with(options().options([("role", role.as_str())]), 8)
}

#[tokio::test]
async fn a_failing_claim_fails_closed_or_with_fail_open_runs_in_a_transaction() {
    let (table, runs) = table_and_counter("claimfail").await;
    let no_extension = role_without_the_extension(&table).await;
    let closed = serve(IdempotencyLayer::new(no_extension.clone()), charging(&table, &runs, Duration::ZERO, 201)).await;
    post(closed, "\"k\"", b"{}", &[]).await.assert_problem(503, "idempotency_unavailable");
    assert_eq!(runs.load(SeqCst), 0);

    let open = serve(IdempotencyLayer::new(no_extension).fail_open(true), charging(&table, &runs, Duration::ZERO, 201)).await;
    let key = unique("k");
    assert_eq!(post(open, &key, b"{}", &[]).await.status, 201);
    let db = connect().await;
    assert_eq!(count_rows(&db, &table).await, 1, "the unguarded run committed");
    assert!(lookup(&db, &key, Some("")).await.unwrap().is_none());
}

#[tokio::test]
async fn a_server_error_rolls_back_and_releases_the_key() {
    let (address, table, runs) = charging_server("fail", IdempotencyLayer::new(pool()), Duration::ZERO, 500).await;
    let key = unique("k");
    let failed = post(address, &key, b"{}", &[]).await;
    assert_eq!(failed.status, 500);
    assert_eq!(failed.header("content-type"), Some("application/json"), "the handler's own response");
    let db = connect().await;
    assert_eq!(count_rows(&db, &table).await, 0);
    assert!(lookup(&db, &key, Some("")).await.unwrap().is_none());
    let again = post(address, &key, b"{}", &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (500, None));
    assert_ne!(again.body, failed.body, "it ran again");
    assert_eq!(runs.load(SeqCst), 2);
}

#[tokio::test]
async fn with_store_server_errors_a_server_error_is_replayed() {
    let layer = IdempotencyLayer::new(pool_with_settings(&[("idempotency.store_server_errors", "on")]));
    let (address, table, runs) = charging_server("store5xx", layer, Duration::ZERO, 500).await;
    let key = unique("k");
    let failed = post(address, &key, b"{}", &[]).await;
    let again = post(address, &key, b"{}", &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (500, Some("true")));
    assert_eq!(again.body, failed.body);
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(count_rows(&connect().await, &table).await, 0, "its writes still rolled back");
}

#[tokio::test]
async fn a_response_the_store_refuses_is_503_and_rolls_back() {
    let layer = IdempotencyLayer::new(pool_with_settings(&[("idempotency.max_response_bytes", "8")]));
    let (address, table, _) = charging_server("toolarge", layer, Duration::ZERO, 201).await;
    let key = unique("k");
    post(address, &key, b"{}", &[]).await.assert_problem(503, "idempotency_unavailable");
    let db = connect().await;
    assert_eq!(count_rows(&db, &table).await, 0);
    assert!(lookup(&db, &key, Some("")).await.unwrap().is_none(), "the key was released");

    // A 5xx over the limit is released all the same.
    let layer = IdempotencyLayer::new(pool_with_settings(&[("idempotency.max_response_bytes", "8")]));
    let (address, _, runs) = charging_server("toolarge5xx", layer, Duration::ZERO, 500).await;
    assert_eq!(post(address, &key, b"{}", &[]).await.status, 500);
    assert!(lookup(&db, &key, Some("")).await.unwrap().is_none(), "the key was released");
    assert_eq!(post(address, &key, b"{}", &[]).await.status, 500);
    assert_eq!(runs.load(SeqCst), 2);
}

#[tokio::test]
async fn a_handler_error_rolls_back_releases_and_is_returned() {
    let table = unique("err");
    create_table(&connect().await, &table).await;
    let handler = {
        let table = table.clone();
        move |request: Request<RequestBody<Body>>| {
            let (table, tx) = (table.clone(), request.extensions().get::<Tx>().unwrap().clone());
            async move {
                insert(tx, &table).await;
                Err::<Response<Body>, _>(std::io::Error::other("handler failed"))
            }
        }
    };
    let service = IdempotencyLayer::new(pool()).layer(tower::service_fn(handler));
    let key = unique("k");
    let request = Request::post("/payments").header("idempotency-key", &key).body(Body::from("{}")).unwrap();
    let err = service.oneshot(request).await.unwrap_err();
    assert_eq!(err.to_string(), "handler failed");
    let db = connect().await;
    assert_eq!(count_rows(&db, &table).await, 0);
    assert!(lookup(&db, &key, Some("")).await.unwrap().is_none());
}

#[tokio::test]
async fn a_handler_that_panics_leaves_neither_its_writes_nor_its_transaction_behind() {
    let (table, runs) = table_and_counter("panic").await;
    let handler = inserting(&table, &runs, Duration::ZERO, |id, run, _| {
        assert!(run > 0, "the handler panics after its first insert (this panic is expected)");
        json_response(201, format!("{{\"charge\":{}}}", id))
    });
    // One connection: the second request gets the one the panic left.
    let address = serve(IdempotencyLayer::new(pool_with(options(), 1)), handler).await;
    let no_answer = tokio::spawn(async move { post(address, &unique("k"), b"{}", &[]).await });
    assert!(no_answer.await.is_err(), "the connection closes without a response");
    assert_eq!(post(address, &unique("k"), b"{}", &[]).await.status, 201);
    assert_eq!(count_rows(&connect().await, &table).await, 1, "only the second request's insert committed");
}

#[tokio::test]
async fn of_many_concurrent_requests_with_one_key_exactly_one_runs() {
    let layer = IdempotencyLayer::new(pool());
    let (address, table, runs) = charging_server("concurrent", layer, Duration::from_millis(300), 201).await;
    let key = unique("k");
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let key = key.clone();
            tokio::spawn(async move { post(address, &key, b"{\"amount\":1}", &[]).await })
        })
        .collect();
    let mut ran = 0;
    for request in requests {
        let reply = request.await.unwrap();
        match (reply.status, reply.header("idempotent-replayed")) {
            (201, None) => ran += 1,
            (201, Some("true")) => {}
            _ => reply.assert_problem(409, "idempotency_key_in_progress"),
        }
    }
    assert_eq!((ran, runs.load(SeqCst)), (1, 1));
    assert_eq!(count_rows(&connect().await, &table).await, 1);
}

#[tokio::test]
async fn the_scope_is_a_hash_of_the_credential() {
    let (address, _, runs) = charging_server("scope", IdempotencyLayer::new(pool()), Duration::ZERO, 201).await;
    let key = unique("k");
    let callers = [
        vec![("Authorization", "Bearer sk_alice")],
        vec![("Authorization", "Bearer sk_bob")],
        vec![("X-API-Key", "sk_carol")],
        vec![],
    ];
    for headers in &callers {
        let reply = post(address, &key, b"{}", headers).await;
        assert_eq!((reply.status, reply.header("idempotent-replayed")), (201, None));
    }
    assert_eq!(runs.load(SeqCst), callers.len(), "keys of different callers never meet");

    let db = connect().await;
    let sha256_hex = |text: &str| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(text.as_bytes()))
    };
    for scope in [sha256_hex("authorization:Bearer sk_alice"), sha256_hex("x-api-key:sk_carol"), String::new()] {
        assert!(lookup(&db, &key, Some(&scope)).await.unwrap().is_some(), "scope {:?}", scope);
    }
    let leaked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency.keys WHERE key = $1 AND (scope ~ 'sk_' OR headers::text ~ 'sk_')")
            .bind(&key)
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(leaked, 0, "the credential itself is never stored");
}

#[tokio::test]
async fn the_layer_fingerprints_the_request_as_the_database_does() {
    let (address, _, _) = charging_server("fp", IdempotencyLayer::new(pool()), Duration::ZERO, 201).await;
    let db = connect().await;
    // The target sent, its body, and the query and body the fingerprint hashes.
    type Case<'a> = (&'a str, &'a [u8], Option<&'a str>, Option<&'a [u8]>);
    let cases: [Case; 3] = [
        ("/payments?b=2&a=1", b"\x00{\"amount\":1}\xff", Some("b=2&a=1"), Some(b"\x00{\"amount\":1}\xff")),
        ("/payments?", b"", None, None),
        ("/payments", b"", None, None),
    ];
    for (target, body, query, stored_body) in cases {
        let key = unique("k");
        let reply = send(address, "POST", target, &[("Idempotency-Key", &key)], body).await;
        assert_eq!(reply.status, 201);
        let record = lookup(&db, &key, Some("")).await.unwrap().unwrap();
        let theirs: Vec<u8> = sqlx::query_scalar("SELECT idempotency.fingerprint('POST', '/payments', $1, $2)")
            .bind(stored_body)
            .bind(query)
            .fetch_one(&db)
            .await
            .unwrap();
        assert_eq!(record.fingerprint, theirs, "{}", target);
    }
}

#[tokio::test]
async fn other_methods_pass_through_untouched() {
    let handler = |request: Request<Body>| {
        let lent = request.extensions().get::<Tx>().is_some();
        async move { json_response(200, format!("{{\"tx\":{}}}", lent)) }
    };
    let address = serve(IdempotencyLayer::new(unreachable_pool()), handler).await;
    for method in ["GET", "PUT", "DELETE"] {
        let reply = send(address, method, "/", &[], b"").await;
        assert_eq!((reply.status, reply.json()), (200, serde_json::json!({"tx": false})), "{}", method);
    }
    let address = serve(IdempotencyLayer::new(unreachable_pool()).methods([Method::PUT]), handler).await;
    send(address, "PUT", "/", &[], b"").await.assert_problem(400, "idempotency_key_missing");
    assert_eq!(send(address, "POST", "/", &[], b"").await.status, 200);
}

#[tokio::test]
async fn with_the_key_optional_a_request_without_one_runs_in_a_transaction() {
    let layer = IdempotencyLayer::new(pool()).key_required(false);
    let (address, table, runs) = charging_server("optional", layer, Duration::ZERO, 201).await;
    for _ in 0..2 {
        assert_eq!(send(address, "POST", "/payments", &[], b"{}").await.status, 201);
    }
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (2, 2));
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let layer = IdempotencyLayer::new(pool()).max_body_bytes(10);
    let (address, _, runs) = charging_server("limit", layer, Duration::ZERO, 201).await;
    post(address, "\"k\"", &[b'x'; 11], &[]).await.assert_problem(413, "request_body_too_large");
    assert_eq!(post(address, &unique("k"), &[b'x'; 10], &[]).await.status, 201);
    assert_eq!(runs.load(SeqCst), 1);
}

#[test]
fn the_default_scope_prefers_authorization_and_is_empty_without_a_credential() {
    let parts = |headers: &[(&str, &str)]| {
        let mut request = Request::post("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    };
    let both = parts(&[("x-api-key", "k"), ("authorization", "a")]);
    assert_eq!(credential_scope(&both), credential_scope(&parts(&[("authorization", "a")])));
    assert_ne!(credential_scope(&both), credential_scope(&parts(&[("x-api-key", "k")])));
    assert_eq!(credential_scope(&parts(&[])), "");
}
