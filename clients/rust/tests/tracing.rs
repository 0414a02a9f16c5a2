//! The `tracing` spans of the layer and the client, recorded in memory by a
//! tracing-subscriber layer (the process's global subscriber: this file is
//! a test binary of its own), against the real database, in both modes of
//! the layer: their names and
//! fields for a fresh request, a replay, a mismatch, a release, an error;
//! and no span or event anywhere carries the raw key, the scope or a body.

mod common;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Mutex, OnceLock};

use axum::body::Body;
use axum::http::{Request, Response};
use common::{connect, post, serve, unique};
use pg_idempotency::IdempotencyLayer;
use sha2::{Digest, Sha256};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A span or an event as recorded: its name (an event's: its target) and its fields as text.
#[derive(Clone, Debug)]
struct Recorded {
    span: bool,
    name: String,
    fields: BTreeMap<String, String>,
}

/// Everything recorded since the process started.
fn recorded() -> &'static Mutex<Vec<Recorded>> {
    static RECORDED: OnceLock<Mutex<Vec<Recorded>>> = OnceLock::new();
    RECORDED.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(InMemory);
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        Mutex::new(Vec::new())
    })
}

/// Collects fields as text.
struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    /// A field's value as `Debug` shows it (strings without quotes).
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

/// The recording layer: spans when they close, events as they happen.
struct InMemory;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for InMemory {
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attributes.record(&mut Fields(&mut fields));
        let span = ctx.span(id).unwrap();
        span.extensions_mut().insert(Recorded { span: true, name: span.name().to_owned(), fields });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        if let Some(recorded) = span.extensions_mut().get_mut::<Recorded>() {
            values.record(&mut Fields(&mut recorded.fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let name = event.metadata().target().to_owned();
        recorded().lock().unwrap().push(Recorded { span: false, name, fields });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id).unwrap().extensions_mut().remove::<Recorded>() {
            recorded().lock().unwrap().push(span);
        }
    }
}

/// The key's hash as every client writes it: 16 hex digits of its SHA-256.
fn key_hash(key: &str) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

/// The spans recorded so far with this name and key hash.
fn spans(name: &str, key: &str) -> Vec<BTreeMap<String, String>> {
    let hash = key_hash(key);
    let all = recorded().lock().unwrap();
    let of_key = all.iter().filter(|r| r.span && r.name == name);
    of_key.filter(|r| r.fields.get("idempotency.key_hash") == Some(&hash)).map(|r| r.fields.clone()).collect()
}

/// The one value of `field` in each of these spans.
fn values<'a>(spans: &'a [BTreeMap<String, String>], field: &str) -> Vec<&'a str> {
    spans.iter().map(|span| span.get(field).map(String::as_str).unwrap_or("(absent)")).collect()
}

#[tokio::test]
async fn spans_name_the_outcome_and_never_the_key_scope_or_body() {
    // One scenario at a time: the trigger it adds sees every claim.
    spans_of_the_layer(false).await;
    spans_of_the_layer(true).await;
}

/// The scenario, with the layer in the mode `one_transaction` says.
async fn spans_of_the_layer(one_transaction: bool) {
    recorded();
    let db = connect().await;
    let secret_scope = unique("secret-scope");
    let scope = secret_scope.clone();
    let layer = IdempotencyLayer::new(common::pool()).scope(move |_| scope.clone()).one_transaction(one_transaction);
    let address = serve(layer, |request: Request<Body>| async move {
        // The status asked for, echoing a secret in the body.
        let status: u16 = request.uri().query().and_then(|q| q.strip_prefix("status=")).unwrap_or("201").parse().unwrap();
        Response::builder().status(status).body(Body::from("secret-response-body")).unwrap()
    })
    .await;
    let (fresh, refused) = (unique("secret-key-fresh"), unique("secret-key-refused"));

    let first = post(address, &fresh, b"secret-request-body", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(post(address, &fresh, b"secret-request-body", &[]).await.header("idempotent-replayed"), Some("true"));
    assert_eq!(post(address, &fresh, b"another-secret-body", &[]).await.status, 422);

    let claims = spans("idempotency.claim", &fresh);
    assert_eq!(values(&claims, "idempotency.outcome"), ["new", "replay", "mismatch"], "{claims:?}");
    assert_eq!(values(&claims, "idempotency.attempt"), ["1", "(absent)", "(absent)"], "{claims:?}");
    assert_eq!(values(&claims, "otel.kind"), ["internal"; 3]);
    let completes = spans("idempotency.complete", &fresh);
    assert_eq!(values(&completes, "idempotency.outcome"), ["stored"], "{completes:?}");
    assert_eq!(values(&completes, "idempotency.attempt"), ["1"], "{completes:?}");
    assert!(claims.iter().chain(&completes).all(|span| !span.contains_key("otel.status_code")));

    // A 5xx is released by complete; a 408 (a timeout's answer) by release,
    // or, in one transaction, by the rollback of its claim.
    let failed = unique("secret-key-5xx");
    let timed_out = unique("secret-key-408");
    send_with_status(address, &failed, 500).await;
    send_with_status(address, &timed_out, 408).await;
    assert_eq!(values(&spans("idempotency.complete", &failed), "idempotency.outcome"), ["released"]);
    let released = spans("idempotency.release", &timed_out);
    let expected: &[&str] = if one_transaction { &[] } else { &["released"] };
    assert_eq!(values(&released, "idempotency.outcome"), expected);

    // A DBA's trigger refuses the key with a message that quotes it: the
    // span has the error and its SQLSTATE, and no log line repeats the message.
    let trigger = unique("refuse_secret_keys");
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {trigger}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.key = '{refused}' THEN RAISE EXCEPTION 'key % refused', NEW.key USING ERRCODE = 'XX42A'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER {trigger} BEFORE INSERT ON idempotency.keys FOR EACH ROW EXECUTE FUNCTION {trigger}()"
    ))
    .execute(&db)
    .await
    .unwrap();
    let answer = post(address, &refused, b"secret-request-body", &[]).await;
    sqlx::raw_sql(&format!("DROP TRIGGER {trigger} ON idempotency.keys; DROP FUNCTION {trigger}()"))
        .execute(&db)
        .await
        .unwrap();
    answer.assert_problem(503, "idempotency_unavailable");
    let refusals = spans("idempotency.claim", &refused);
    assert_eq!(values(&refusals, "otel.status_code"), ["ERROR"], "{refusals:?}");
    assert_eq!(values(&refusals, "db.response.status_code"), ["XX42A"], "{refusals:?}");

    // SQLx's own statement log (target sqlx::query, DEBUG, or WARN when
    // slower than 1 s) shows the statements' text, which carries the
    // arguments as literals (see README, "Through a transaction pooler").
    let all = recorded().lock().unwrap();
    assert!(all.iter().any(|r| !r.span && r.name.starts_with("pg_idempotency")), "the failed claim was logged");
    for record in all.iter().filter(|r| r.name != "sqlx::query") {
        for (name, value) in &record.fields {
            for secret in [fresh.as_str(), refused.as_str(), failed.as_str(), timed_out.as_str(), &secret_scope, "secret-"] {
                assert!(!value.contains(secret), "{} {name} = {value:?} carries {secret:?}", record.name);
            }
        }
    }
}

/// POSTs with `key` a request whose handler answers `status`.
async fn send_with_status(address: std::net::SocketAddr, key: &str, status: u16) {
    let target = format!("/payments?status={status}");
    let reply = common::send(address, "POST", &target, &[("Idempotency-Key", key)], b"secret-request-body").await;
    assert_eq!(reply.status, status, "{reply:?}");
}
