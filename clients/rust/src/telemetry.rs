//! The `tracing` spans of the calls into the extension, named and
//! attributed as in every client of the project (so that operators can
//! correlate languages): `idempotency.claim`, `idempotency.complete`,
//! `idempotency.release`, with `idempotency.outcome`, `idempotency.attempt`
//! and `idempotency.key_hash`, never the key, the scope or a body. An error
//! sets `otel.status_code = "ERROR"` and `db.response.status_code` (the
//! SQLSTATE). `otel.kind` and `otel.status_code` are the fields
//! tracing-opentelemetry reads as the span's kind and status.

use std::future::Future;

use sha2::{Digest, Sha256};
use tracing::{Instrument, Span};

use crate::Error;

/// The first 16 lowercase hex digits of SHA-256 of the key's UTF-8 bytes:
/// names a key in telemetry and logs without revealing it.
pub(crate) fn key_hash(key: &str) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

/// Runs `call` in `span`, then records its outcome (what `outcome` says of
/// a success) or its error.
pub(crate) async fn traced<T>(
    span: Span,
    call: impl Future<Output = Result<T, Error>>,
    outcome: impl FnOnce(&T, &Span),
) -> Result<T, Error> {
    let result = call.instrument(span.clone()).await;
    match &result {
        Ok(value) => outcome(value, &span),
        Err(err) => {
            span.record("otel.status_code", "ERROR");
            if let Some(code) = err.sqlstate() {
                span.record("db.response.status_code", code.as_str());
            }
        }
    }
    result
}

/// A span for the call into the extension named `$name`, on a key.
macro_rules! call_span {
    ($name:literal, $key:expr) => {
        tracing::info_span!(
            $name,
            otel.kind = "internal",
            idempotency.key_hash = %$crate::telemetry::key_hash($key),
            idempotency.outcome = tracing::field::Empty,
            idempotency.attempt = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            db.response.status_code = tracing::field::Empty,
        )
    };
}
pub(crate) use call_span;
