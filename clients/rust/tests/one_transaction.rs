//! `IdempotencyLayer::one_transaction(true)` against the database: the
//! claim, the handler's writes and the stored response commit together; a
//! failure rolls all of it back (the key is free at once); a concurrent
//! duplicate waits, bounded, for the first and answers from what committed.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use common::{Reply, connect, count_rows, create_table, pool, post, serve, unique};
use pg_idempotency::{IdempotencyLayer, Tx, lookup};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Serves a handler that charges a row of `table` through its `Tx`, then
/// waits for a permit of `gate` (when given), then answers `status` with
/// `{"charge": id}`; counts its runs.
async fn charging(layer: IdempotencyLayer, table: &str, status: u16, gate: Option<Arc<Semaphore>>, runs: &Arc<AtomicUsize>) -> SocketAddr {
    let (table, runs) = (table.to_owned(), runs.clone());
    serve(layer, move |request: Request<Body>| {
        let (table, gate, runs) = (table.clone(), gate.clone(), runs.clone());
        let tx = request.extensions().get::<Tx>().unwrap().clone();
        async move {
            runs.fetch_add(1, SeqCst);
            let id = common::charge(&tx, &table).await;
            if let Some(gate) = gate {
                gate.acquire().await.unwrap().forget();
            }
            Response::builder().status(status).body(Body::from(format!("{{\"charge\":{id}}}"))).unwrap()
        }
    })
    .await
}

/// A table of its own and a run counter.
async fn table_and_runs(name: &str) -> (String, Arc<AtomicUsize>) {
    let table = unique(name);
    create_table(&connect().await, &table).await;
    (table, Arc::new(AtomicUsize::new(0)))
}

/// Sends a request with `key` and returns once its handler runs (it then
/// waits at the gate); its reply comes from the handle.
async fn first_running(address: SocketAddr, key: &str, runs: &AtomicUsize) -> JoinHandle<Reply> {
    let key = key.to_owned();
    let first = tokio::spawn(async move { post(address, &key, b"{}", &[]).await });
    while runs.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first
}

/// Returns once a backend whose statement names `key` waits for a lock (bounded).
async fn wait_for_lock_wait(key: &str) {
    common::wait_for_backend(key, "wait_event_type = 'Lock'").await;
}

#[tokio::test]
async fn a_fresh_request_commits_its_claim_writes_and_response_together() {
    let (table, runs) = table_and_runs("onetx_fresh").await;
    let address = charging(IdempotencyLayer::new(pool()).one_transaction(true), &table, 201, None, &runs).await;
    let key = unique("k");
    let first = post(address, &key, b"{}", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(address, &key, b"{}", &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(again.body, first.body);
    assert_eq!(post(address, &key, b"{\"other\":1}", &[]).await.status, 422);
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (1, 1));
}

#[tokio::test]
async fn a_failure_rolls_back_the_claim_too_and_the_retry_runs_at_once() {
    let (table, runs) = table_and_runs("onetx_failure").await;
    let address = charging(IdempotencyLayer::new(pool()).one_transaction(true), &table, 500, None, &runs).await;
    let key = unique("k");
    assert_eq!(post(address, &key, b"{}", &[]).await.status, 500);
    assert!(lookup(&connect().await, &key, Some("")).await.unwrap().is_none(), "no record kept");
    assert_eq!(post(address, &key, b"{}", &[]).await.status, 500, "the retry ran again");
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (2, 0));
}

#[tokio::test]
async fn a_duplicate_waits_for_the_first_and_replays_what_committed() {
    let (table, runs) = table_and_runs("onetx_duplicate").await;
    let gate = Arc::new(Semaphore::new(0));
    let layer = IdempotencyLayer::new(pool()).one_transaction(true).wait(Duration::from_secs(60));
    let address = charging(layer, &table, 201, Some(gate.clone()), &runs).await;
    let key = unique("k");
    let first = first_running(address, &key, &runs).await;
    // The first holds its claim uncommitted: nobody else sees it.
    assert!(lookup(&connect().await, &key, Some("")).await.unwrap().is_none(), "the claim is not committed yet");
    let duplicate = {
        let key = key.clone();
        tokio::spawn(async move { post(address, &key, b"{}", &[]).await })
    };
    // The duplicate's claim waits for the first's transaction to end.
    wait_for_lock_wait(&key).await;
    gate.add_permits(1);
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((duplicate.status, duplicate.header("idempotent-replayed")), (201, Some("true")), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (1, 1));
}

#[tokio::test]
async fn a_duplicate_past_its_wait_is_a_409_and_the_first_commits() {
    let (table, runs) = table_and_runs("onetx_busy").await;
    let gate = Arc::new(Semaphore::new(0));
    let layer = IdempotencyLayer::new(pool()).one_transaction(true).wait(Duration::from_millis(300));
    let address = charging(layer, &table, 201, Some(gate.clone()), &runs).await;
    let key = unique("k");
    let first = first_running(address, &key, &runs).await;
    // The first cannot finish before the gate opens: the duplicate's wait ends first.
    let busy = post(address, &key, b"{}", &[]).await;
    busy.assert_problem(409, "idempotency_key_in_progress");
    assert!(busy.header("retry-after").is_some_and(|s| s.parse::<u32>().unwrap() >= 1), "{busy:?}");
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!((runs.load(SeqCst), count_rows(&connect().await, &table).await), (1, 1));
}
