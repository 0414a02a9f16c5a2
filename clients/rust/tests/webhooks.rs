//! Webhook receivers and the redact hook, in an axum Router behind the
//! layer against the database: a Standard Webhooks delivery is verified
//! (the `standardwebhooks` crate) before it is claimed, keyed by its
//! `webhook-id` and scoped by the sender; a key can come from the body
//! (`body_key`); `redact` changes what is stored and replayed, not the live
//! response.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{Request, Response};
use common::{Reply, connect, send, serve, unique};
use pg_idempotency::{IdempotencyLayer, StoredResponse, body_key, lookup};
use standardwebhooks::Webhook;

/// The receiver's secret.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Serves a handler that answers 200 with its run number and the request
/// body behind `layer`; counts its runs.
async fn receiver(layer: IdempotencyLayer, runs: &Arc<AtomicUsize>) -> SocketAddr {
    let runs = runs.clone();
    serve(layer, move |request: Request<Body>| {
        let runs = runs.clone();
        async move {
            let run = runs.fetch_add(1, SeqCst) + 1;
            let body = axum::body::to_bytes(request.into_body(), 1 << 20).await.unwrap();
            let text = format!("{{\"run\":{run},\"event\":{}}}", String::from_utf8_lossy(&body));
            Response::builder().status(200).header("content-type", "application/json").body(Body::from(text)).unwrap()
        }
    })
    .await
}

/// A Standard Webhooks receiver of sender `acme`.
fn webhooks_layer() -> IdempotencyLayer {
    let webhook = Webhook::new(SECRET).unwrap();
    IdempotencyLayer::new(common::pool()).standard_webhooks(move |body, headers| webhook.verify(body, headers), "acme")
}

/// Delivers `body` as event `id`, signed with `secret` at `timestamp` (now by default).
async fn deliver(address: SocketAddr, id: &str, body: &str, secret: &str, timestamp: Option<i64>) -> Reply {
    let timestamp = timestamp.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64);
    let signature = Webhook::new(secret).unwrap().sign(id, timestamp, body.as_bytes()).unwrap();
    let headers = [
        ("webhook-id", id),
        ("webhook-timestamp", &timestamp.to_string()),
        ("webhook-signature", &signature),
        ("content-type", "application/json"),
    ];
    send(address, "POST", "/webhooks", &headers, body.as_bytes()).await
}

#[tokio::test]
async fn a_verified_delivery_runs_once_and_a_redelivery_gets_the_stored_answer() {
    let runs = Arc::new(AtomicUsize::new(0));
    let address = receiver(webhooks_layer(), &runs).await;
    let id = unique("msg");
    let first = deliver(address, &id, r#"{"amount":5}"#, SECRET, None).await;
    assert_eq!(first.status, 200, "{first:?}");
    let again = deliver(address, &id, r#"{"amount":5}"#, SECRET, None).await;
    assert_eq!((again.status, &again.body), (200, &first.body));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(SeqCst), 1);
    assert!(lookup(&connect().await, &id, Some("webhook:acme")).await.unwrap().is_some(), "scoped by the sender");
    // The same id with another payload: the key belongs to the first.
    let other = deliver(address, &id, r#"{"amount":6}"#, SECRET, None).await;
    other.assert_problem(422, "idempotency_key_mismatch");
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn an_unverified_delivery_is_never_claimed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let address = receiver(webhooks_layer(), &runs).await;
    let forged = unique("msg");
    let reply = deliver(address, &forged, r#"{"amount":5}"#, "whsec_c2VjcmV0IG9mIHNvbWVvbmUgZWxzZQ==", None).await;
    reply.assert_problem(401, "webhook_unverified");
    let stale = unique("msg");
    let old = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64 - 3600;
    deliver(address, &stale, r#"{"amount":5}"#, SECRET, Some(old)).await.assert_problem(401, "webhook_unverified");
    assert_eq!(runs.load(SeqCst), 0);
    let db = connect().await;
    for id in [&forged, &stale] {
        assert!(lookup(&db, id, Some("webhook:acme")).await.unwrap().is_none(), "no record of {id}");
    }
}

#[tokio::test]
async fn a_key_from_the_body() {
    let runs = Arc::new(AtomicUsize::new(0));
    let address = receiver(IdempotencyLayer::new(common::pool()).key(body_key("id")), &runs).await;
    let id = unique("evt");
    let event = format!(r#"{{"id":"{id}","type":"charge.succeeded"}}"#);
    let first = send(address, "POST", "/stripe", &[], event.as_bytes()).await;
    let again = send(address, "POST", "/stripe", &[], event.as_bytes()).await;
    assert_eq!((first.status, again.status), (200, 200));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(SeqCst), 1);
    send(address, "POST", "/stripe", &[], br#"{"type":"x"}"#).await.assert_problem(400, "idempotency_key_missing");
    send(address, "POST", "/stripe", &[], br#"{"id":7}"#).await.assert_problem(400, "idempotency_key_invalid");
}

#[tokio::test]
async fn redact_changes_what_is_stored_not_the_live_response() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(common::pool()).redact(|stored: StoredResponse| StoredResponse {
        body: String::from_utf8(stored.body).unwrap().replace("4242", "****").into_bytes(),
        ..stored
    });
    let address = receiver(layer, &runs).await;
    let key = unique("redact");
    let first = common::post(address, &key, br#"{"card":"4242"}"#, &[]).await;
    assert_eq!(first.json()["event"]["card"], "4242", "the live response is unchanged");
    let again = common::post(address, &key, br#"{"card":"4242"}"#, &[]).await;
    assert_eq!(again.json()["event"]["card"], "****", "a replay sends what was stored");
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_redact_hook_that_panics_stores_nothing_and_frees_the_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let fail = Arc::new(AtomicBool::new(true));
    let failing = fail.clone();
    let layer = IdempotencyLayer::new(common::pool()).redact(move |stored: StoredResponse| {
        assert!(!failing.load(SeqCst), "no card number to mask");
        stored
    });
    let address = receiver(layer, &runs).await;
    let key = unique("redact-panics");
    common::post(address, &key, br#"{"card":"4242"}"#, &[]).await.assert_problem(500, "idempotency_redact_failed");
    fail.store(false, SeqCst);
    let again = common::post(address, &key, br#"{"card":"4242"}"#, &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (200, None), "nothing was stored: it runs again");
    assert_eq!(runs.load(SeqCst), 2);
}
