//! Idempotency-Key for HTTP APIs, on the PostgreSQL extension `idempotency`
//! (version 1.2 or later).
//!
//! - [`IdempotencyLayer`]: a tower 0.5 `Layer` for axum 0.8 (or any tower
//!   service on http 1) that follows docs/http-contract.md. It claims the
//!   key on the application's `sqlx::PgPool`, lends the handler the
//!   request's `sqlx::Transaction` as a [`Tx`] (an axum extractor, begun
//!   when the handler first locks it), and stores the response in that
//!   transaction, so that the business writes and the stored response
//!   commit together. It takes any request body, as tower-http's layers do.
//!   With `one_transaction(true)` the claim is made in that transaction too.
//!   Each call is a `tracing` span (`idempotency.claim`, `idempotency.complete`,
//!   `idempotency.release`) that names the key only by a hash.
//! - [`claim`], [`Owner::complete`], [`Owner::release`], [`Owner::extend`],
//!   [`Owner::checkpoint`], [`lookup`]: the SQL API with typed outcomes on
//!   any SQLx executor, and [`Error::ClaimLost`] for IK001.
//! - [`idempotent`] and [`Function`]: an idempotent function beyond HTTP (a
//!   job, a message): the work runs once per key with a transaction that
//!   commits with its stored result (serde JSON), and a duplicate gets that
//!   result back; the same flow as the layer.
//! - [`fingerprint`]: the request hash, equal to `idempotency.fingerprint()`.

mod body;
mod client;
mod error;
mod fingerprint;
mod flow;
mod function;
mod key;
mod layer;
mod problem;
mod sql;
mod telemetry;
mod tx;

pub use body::{IdempotencyBody, RequestBody, ResponseBody};
pub use client::{ClaimOptions, Completion, Outcome, Owner, Record, State, StoredResponse, claim, lookup};
pub use error::Error;
pub use fingerprint::fingerprint;
pub use function::{FUNCTION_WAIT, Function, FunctionError, Work, arguments_fingerprint, idempotent};
pub use key::{IDEMPOTENCY_KEY, parse_key};
pub use layer::{Idempotency, IdempotencyLayer, ONE_TRANSACTION_WAIT, body_key, credential_scope};
pub use tx::{Tx, TxGuard};

/// The Rust snippets of README.md, compiled by `cargo test`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
