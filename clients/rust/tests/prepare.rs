//! `IdempotencyLayer::prepare(true)` (and `Function::prepare`) against the database, in both modes:
//! the claim and `complete` are statements prepared on the connection
//! (pg_prepared_statements of a pool of one connection lists them; without
//! the option it lists neither), and the layer answers as it does without
//! it: the handler's answer, its replay, a mismatch, a 5xx rolled back with
//! its key freed, the lease and retention given.

mod common;

use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::http::{Request, Response};
use common::{count_rows, create_table, options, pool_with, post, serve, unique};
use pg_idempotency::{Function, IdempotencyLayer, Tx, lookup};
use sqlx::PgPool;

/// The layer's retention, which the record's expiry shows.
const RETENTION: Duration = Duration::from_micros(3_600_000_123);

/// Serves, behind `layer`, a handler that charges a row of `table` through
/// its `Tx` and answers 201 `{"charge": id}`, or 500 when the body is `fail`.
async fn charging(layer: IdempotencyLayer, table: &str) -> std::net::SocketAddr {
    let table = table.to_owned();
    serve(layer, move |request: Request<Body>| {
        let table = table.clone();
        async move {
            let tx = request.extensions().get::<Tx>().unwrap().clone();
            let body = to_bytes(request.into_body(), 1024).await.unwrap();
            let id = common::charge(&tx, &table).await;
            let status = if &body[..] == b"fail" { 500 } else { 201 };
            Response::builder().status(status).body(Body::from(format!("{{\"charge\":{id}}}"))).unwrap()
        }
    })
    .await
}

/// The statements prepared on the pool's connection that call `function`.
/// Sent as a simple query, which prepares nothing itself.
async fn prepared_calls(pool: &PgPool, function: &str) -> usize {
    let rows = sqlx::raw_sql("SELECT statement FROM pg_prepared_statements").fetch_all(pool).await.unwrap();
    rows.iter().filter(|row| sqlx::Row::get::<&str, _>(*row, 0).contains(function)).count()
}

/// A fresh key, its replay, a mismatch and a 5xx through a layer on a pool
/// of one connection (so that it is the one the test reads); returns how
/// many statements calling claim and complete that connection prepared.
async fn exchange(one_transaction: bool, prepare: bool) -> (usize, usize) {
    let pool = pool_with(options(), 1);
    let table = unique("prepare_charges");
    create_table(&pool, &table).await;
    let layer = IdempotencyLayer::new(pool.clone())
        .one_transaction(one_transaction)
        .prepare(prepare)
        .lease(Duration::from_secs(30))
        .retention(RETENTION);
    let address = charging(layer, &table).await;
    let key = unique("prepare");

    let first = post(address, &key, b"{}", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let record = lookup(&pool, &key, Some("")).await.unwrap().expect("the record");
    assert_eq!(record.expires_at.duration_since(record.created_at).unwrap(), RETENTION, "the retention as bound");
    let again = post(address, &key, b"{}", &[]).await;
    assert_eq!((again.status, &again.body), (201, &first.body), "{again:?}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    post(address, &key, b"{\"other\":1}", &[]).await.assert_problem(422, "idempotency_key_mismatch");

    let failing = unique("prepare_fail");
    assert_eq!(post(address, &failing, b"fail", &[]).await.status, 500);
    assert!(lookup(&pool, &failing, Some("")).await.unwrap().is_none(), "a 5xx frees its key");
    assert_eq!(count_rows(&pool, &table).await, 1, "the 5xx's charge rolled back");

    (prepared_calls(&pool, "idempotency.claim(").await, prepared_calls(&pool, "idempotency.complete(").await)
}

#[tokio::test]
async fn prepare_prepares_claim_and_complete_in_two_transactions() {
    assert_eq!(exchange(false, true).await, (1, 1));
}

#[tokio::test]
async fn prepare_prepares_claim_and_complete_in_one_transaction() {
    assert_eq!(exchange(true, true).await, (1, 1));
}

#[tokio::test]
async fn without_prepare_nothing_of_the_layer_is_prepared() {
    assert_eq!(exchange(false, false).await, (0, 0));
    assert_eq!(exchange(true, false).await, (0, 0));
}

/// A function's first run and its duplicate on a pool of one connection;
/// returns how many statements calling claim and complete it prepared.
async fn function_calls(one_transaction: bool, prepare: bool) -> (usize, usize) {
    let pool = pool_with(options(), 1);
    let function = Function::new(pool.clone()).one_transaction(one_transaction).prepare(prepare);
    let key = unique("prepare_function");
    for _ in 0..2 {
        let answer: i32 = function.run(&key, &1, |_| async { Ok::<_, String>(7) }).await.unwrap();
        assert_eq!(answer, 7);
    }
    (prepared_calls(&pool, "idempotency.claim(").await, prepared_calls(&pool, "idempotency.complete(").await)
}

#[tokio::test]
async fn a_function_prepares_claim_and_complete_only_when_asked() {
    for one_transaction in [false, true] {
        assert_eq!(function_calls(one_transaction, true).await, (1, 1));
        assert_eq!(function_calls(one_transaction, false).await, (0, 0));
    }
}
