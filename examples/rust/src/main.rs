//! The retried-payment API: POST /payments charges once per Idempotency-Key,
//! on axum 0.8 and SQLx 0.8, inside the request's transaction that
//! pg-idempotency's layer lends the handler.
//!
//! Environment: DATABASE_URL (a database where `CREATE EXTENSION
//! idempotency` is done), PORT (default 3000), ACCOUNTS (the app's
//! authentication: `token=account,...`; a key belongs to the account, so a
//! refreshed token still meets it); for the tests, IDEMPOTENCY_LEASE (an
//! interval; unset: the database's `idempotency.lease`), IDEMPOTENCY_FAIL_OPEN=on and
//! IDEMPOTENCY_ONE_TRANSACTION=on (the claim in the charge's transaction);
//! WEBHOOK_SECRET (`whsec_...`): also serve POST /webhooks, a Standard
//! Webhooks receiver that charges each event's `data.amount` once.
//! Listens on 127.0.0.1.

use std::collections::HashMap;
use std::env;
use std::error::Error;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{StatusCode, request::Parts};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pg_idempotency::{IdempotencyLayer, Tx, credential_scope};
use standardwebhooks::Webhook;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const CREATE_CHARGES: &str = "CREATE TABLE IF NOT EXISTS charges (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    amount numeric NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now())";

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    if let Err(err) = serve().await {
        eprintln!("payments: {err}");
        std::process::exit(1);
    }
}

/// Creates the business table when missing, then serves until killed.
async fn serve() -> Result<(), Box<dyn Error>> {
    let url = env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    // An unreachable database answers 503 within seconds, not a hang.
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(PgConnectOptions::from_str(&with_host(&url))?);
    sqlx::raw_sql(CREATE_CHARGES).execute(&pool).await?;
    // The charge is a row in this database and nothing else, so the claim
    // may commit with it (one_transaction); a route that calls a payment
    // provider keeps the default, two transactions.
    let mut layer = IdempotencyLayer::new(pool.clone())
        .scope(account_scope)
        .fail_open(env::var("IDEMPOTENCY_FAIL_OPEN").as_deref() == Ok("on"))
        .one_transaction(env::var("IDEMPOTENCY_ONE_TRANSACTION").as_deref() == Ok("on"));
    // Without it, each claim passes no lease: the database's idempotency.lease decides.
    if let Ok(lease) = env::var("IDEMPOTENCY_LEASE") {
        layer = layer.lease(lease_of(&pool, &lease).await?);
    }
    let accounts = Arc::new(accounts_of(&env::var("ACCOUNTS").unwrap_or_default())?);

    // The last layer is the outermost: authentication, then the idempotency key.
    let mut app = Router::new().route("/", get(health)).route("/payments", post(pay)).fallback(not_found).layer(layer);
    if let Ok(secret) = env::var("WEBHOOK_SECRET") {
        // Verified before the claim, keyed by webhook-id, scoped by the sender.
        let webhook = Webhook::new(&secret).map_err(|err| format!("WEBHOOK_SECRET: {err}"))?;
        let receiver = IdempotencyLayer::new(pool.clone())
            .standard_webhooks(move |body, headers| webhook.verify(body, headers), "standard-webhooks");
        app = app.route("/webhooks", post(receive).layer(receiver));
    }
    let app = app.layer(middleware::from_fn_with_state(accounts, authenticate));
    let port: u16 = env::var("PORT").unwrap_or_else(|_| "3000".into()).parse()?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// The account a request's credential belongs to, as authentication found it.
#[derive(Clone)]
struct Account(String);

/// Reads ACCOUNTS: `token=account` pairs, comma-separated.
fn accounts_of(list: &str) -> Result<HashMap<String, String>, String> {
    let pairs = list.split(',').map(str::trim).filter(|pair| !pair.is_empty());
    pairs
        .map(|pair| match pair.split_once('=') {
            Some((token, account)) => Ok((format!("Bearer {token}"), account.to_owned())),
            None => Err(format!("ACCOUNTS: {pair:?} is not token=account")),
        })
        .collect()
}

/// The app's authentication: a known bearer token names its account. This
/// demo lets other callers through (the HTTP contract's tests send tokens
/// it does not know); a real app answers 401.
async fn authenticate(State(accounts): State<Arc<HashMap<String, String>>>, mut request: Request, next: Next) -> Response {
    let credential = request.headers().get("authorization").and_then(|value| value.to_str().ok());
    if let Some(account) = credential.and_then(|credential| accounts.get(credential)) {
        request.extensions_mut().insert(Account(account.clone()));
    }
    next.run(request).await
}

/// Whose key it is: the authenticated account, so a retry after an OAuth
/// token refresh still meets its key. Without one, the layer's default: a
/// hash of the credential (a refreshed token would be a new scope).
fn account_scope(request: &Parts) -> String {
    match request.extensions.get::<Account>() {
        Some(account) => account.0.clone(),
        None => credential_scope(request),
    }
}

/// libpq's Unix-socket form, `postgresql://user@/db?host=/dir` (no host before the path), with
/// `localhost` there: SQLx's URL parser refuses an empty host, and its `host=/dir` then picks the socket.
fn with_host(url: &str) -> String {
    for scheme in ["postgresql://", "postgres://"] {
        let Some(rest) = url.strip_prefix(scheme) else { continue };
        let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
        let host_at = authority.rfind('@').map_or(0, |at| at + 1);
        if authority[host_at..].is_empty() || authority[host_at..].starts_with(':') {
            return format!("{scheme}{}localhost{}", &rest[..host_at], &rest[host_at..]);
        }
    }
    url.to_string()
}

/// The database reads the interval, as it would read the setting idempotency.lease.
async fn lease_of(pool: &PgPool, lease: &str) -> Result<Duration, Box<dyn Error>> {
    let micros: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM $1::text::interval) * 1000000)::int8")
        .bind(lease)
        .fetch_one(pool)
        .await?;
    if micros <= 0 {
        return Err(format!("IDEMPOTENCY_LEASE must be positive, not {lease:?}").into());
    }
    Ok(Duration::from_micros(micros as u64))
}

/// GET /: the health check, without the database.
async fn health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

/// Any other route.
async fn not_found() -> Response {
    json_response(StatusCode::NOT_FOUND, json!({"error": "not found"}))
}

/// What POST /payments asks for.
struct Payment {
    amount: String,
    delay: Duration,
    fail: bool,
}

/// Charges the amount in the request's transaction. Test knobs: `delay_ms`
/// sleeps first, `fail` answers 500 after the charge was written (the layer
/// rolls it back). No `Tx`: the layer failed open without a database.
async fn pay(tx: Option<Tx>, body: Bytes) -> Response {
    let payment = match parse_payment(&body) {
        Ok(payment) => payment,
        Err(why) => return json_response(StatusCode::BAD_REQUEST, json!({ "error": why })),
    };
    tokio::time::sleep(payment.delay).await;
    let Some(tx) = tx else {
        return json_response(StatusCode::SERVICE_UNAVAILABLE, json!({"error": "the database is unavailable"}));
    };
    let charge = match insert_charge(&tx, &payment.amount).await {
        Ok(charge) => charge,
        Err(err) => {
            eprintln!("payments: could not charge: {err}");
            let error = json!({"error": "the charge could not be written"});
            return json_response(StatusCode::INTERNAL_SERVER_ERROR, error);
        }
    };
    if payment.fail {
        let error = json!({ "error": format!("charge {charge} was declined") });
        return json_response(StatusCode::INTERNAL_SERVER_ERROR, error);
    }
    json_response(StatusCode::CREATED, json!({ "charge": charge }))
}

/// POST /webhooks: charges the event's `data.amount` (after `data.delay_ms`)
/// in the delivery's transaction, as POST /payments does, and answers 200.
async fn receive(tx: Tx, body: Bytes) -> Response {
    let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let payment = match parse_payment(&serde_json::to_vec(&event["data"]).unwrap_or_default()) {
        Ok(payment) => payment,
        Err(why) => return json_response(StatusCode::BAD_REQUEST, json!({ "error": why })),
    };
    tokio::time::sleep(payment.delay).await;
    match insert_charge(&tx, &payment.amount).await {
        Ok(charge) => json_response(StatusCode::OK, json!({ "charge": charge })),
        Err(err) => {
            eprintln!("payments: could not charge: {err}");
            json_response(StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "the charge could not be written"}))
        }
    }
}

/// Reads `{"amount": N > 0, "delay_ms"?: N, "fail"?: bool}`.
fn parse_payment(body: &[u8]) -> Result<Payment, &'static str> {
    let order: Value = serde_json::from_slice(body).map_err(|_| "the body is not JSON")?;
    let amount = match &order["amount"] {
        Value::Number(n) if n.as_f64().is_some_and(|n| n > 0.0) => n.to_string(),
        _ => return Err("amount must be a positive number"),
    };
    let delay_ms = match &order["delay_ms"] {
        Value::Null => 0,
        delay => delay.as_u64().ok_or("delay_ms must be a whole number of milliseconds")?,
    };
    let fail = match &order["fail"] {
        Value::Null => false,
        fail => fail.as_bool().ok_or("fail must be true or false")?,
    };
    Ok(Payment { amount, delay: Duration::from_millis(delay_ms), fail })
}

/// Writes the charge in the request's transaction; returns its id.
async fn insert_charge(tx: &Tx, amount: &str) -> Result<i64, Box<dyn Error>> {
    let mut db = tx.lock().await?;
    let id = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id")
        .bind(amount)
        .fetch_one(&mut *db)
        .await?;
    Ok(id)
}

/// A JSON response (axum's `Json` sets `Content-Type: application/json`).
fn json_response(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}
