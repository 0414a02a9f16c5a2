//! The retried-payment API: POST /payments charges once per Idempotency-Key.
//!
//! Environment: DATABASE_URL (a database where `CREATE EXTENSION
//! idempotency` is done), PORT (default 3000); for the tests,
//! IDEMPOTENCY_LEASE (an interval, default `60 seconds`) and
//! IDEMPOTENCY_FAIL_OPEN=on. Listens on 127.0.0.1.

use std::convert::Infallible;
use std::env;
use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::service::{make_service_fn, service_fn};
use hyper::{Body, Method, Request, Response, Server};
use pg_idempotency::tokio_postgres::{Config, NoTls};
use pg_idempotency::{IdempotencyLayer, Pool, Tx};
use serde_json::{json, Value};
use tower::Layer;

const CREATE_CHARGES: &str = "CREATE TABLE IF NOT EXISTS charges (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    amount numeric NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now())";

#[tokio::main]
async fn main() {
    log::set_logger(&StderrLogger).expect("the only logger");
    log::set_max_level(log::LevelFilter::Info);
    if let Err(err) = serve().await {
        eprintln!("payments: {}", err);
        std::process::exit(1);
    }
}

/// Creates the business table when missing, then serves until killed.
async fn serve() -> Result<(), Box<dyn Error>> {
    let mut config: Config = env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?.parse()?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5)); // an unreachable database answers 503, not a hang
    }
    let pool = Pool::new(config, NoTls, 10);
    let db = pool.get().await?;
    db.batch_execute(CREATE_CHARGES).await?;
    let lease = env::var("IDEMPOTENCY_LEASE").unwrap_or_else(|_| "60 seconds".into());
    // The database reads the interval, as it would read the setting idempotency.lease.
    let lease_micros: i64 = db
        .query_one("SELECT (extract(epoch FROM $1::text::interval) * 1000000)::int8", &[&lease])
        .await?
        .get(0);
    drop(db);
    if lease_micros <= 0 {
        return Err(format!("IDEMPOTENCY_LEASE must be positive, not {:?}", lease).into());
    }

    let layer = IdempotencyLayer::new(pool)
        .lease(Duration::from_micros(lease_micros as u64))
        .fail_open(env::var("IDEMPOTENCY_FAIL_OPEN").as_deref() == Ok("on"));
    let service = layer.layer(service_fn(route));
    let port: u16 = env::var("PORT").unwrap_or_else(|_| "3000".into()).parse()?;
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let server = Server::try_bind(&address)?.serve(make_service_fn(move |_| {
        let service = service.clone();
        async move { Ok::<_, Infallible>(service) }
    }));
    eprintln!("listening on http://{}", address);
    server.await?;
    Ok(())
}

/// Routes: the health check and the payments.
async fn route(request: Request<Body>) -> Result<Response<Body>, Infallible> {
    Ok(match (request.method(), request.uri().path()) {
        (&Method::GET, "/") => json_response(200, json!({"status": "ok"})),
        (&Method::POST, "/payments") => pay(request).await,
        _ => json_response(404, json!({"error": "not found"})),
    })
}

/// What POST /payments asks for.
struct Payment {
    amount: String,
    delay: Duration,
    fail: bool,
}

/// Charges the amount. Test knobs: `delay_ms` sleeps first, `fail` answers
/// 500 after the charge was written (the layer rolls it back).
async fn pay(request: Request<Body>) -> Response<Body> {
    let tx = request.extensions().get::<Tx>().cloned();
    let payment = match hyper::body::to_bytes(request.into_body()).await {
        Ok(body) => parse_payment(&body),
        Err(_) => Err("the body could not be read"),
    };
    let payment = match payment {
        Ok(payment) => payment,
        Err(why) => return json_response(400, json!({ "error": why })),
    };
    tokio::time::sleep(payment.delay).await;
    // No transaction: the layer failed open without a database.
    let tx = match tx {
        Some(tx) => tx,
        None => return json_response(503, json!({"error": "the database is unavailable"})),
    };
    let charge = match insert_charge(&tx, &payment.amount).await {
        Ok(charge) => charge,
        Err(err) => {
            log::error!("could not charge: {}", err);
            return json_response(500, json!({"error": "the charge could not be written"}));
        }
    };
    if payment.fail {
        return json_response(500, json!({ "error": format!("charge {} was declined", charge) }));
    }
    json_response(201, json!({ "charge": charge }))
}

/// Reads `{"amount": N > 0, "delay_ms"?: N, "fail"?: bool}`.
fn parse_payment(body: &[u8]) -> Result<Payment, &'static str> {
    let order: Value = serde_json::from_slice(body).map_err(|_| "the body is not JSON")?;
    let amount = match &order["amount"] {
        Value::Number(n) if n.as_f64().map_or(false, |n| n > 0.0) => n.to_string(),
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
async fn insert_charge(tx: &Tx, amount: &str) -> Result<i64, pg_idempotency::Error> {
    let db = tx.client().await?;
    let row = db.query_one("INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id", &[&amount]).await?;
    Ok(row.get(0))
}

/// A JSON response.
fn json_response(status: u16, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("a valid response")
}

/// Prints log records of the layer to stderr.
struct StderrLogger;

impl log::Log for StderrLogger {
    /// Every record at the max level or above.
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    /// One line per record.
    fn log(&self, record: &log::Record<'_>) {
        eprintln!("{} {}", record.level(), record.args());
    }

    /// Nothing is buffered.
    fn flush(&self) {}
}
