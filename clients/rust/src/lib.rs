//! Idempotency-Key for HTTP APIs, on the PostgreSQL extension `idempotency`.
//!
//! - [`IdempotencyLayer`]: a tower `Layer` (hyper 0.14, axum 0.6) that
//!   follows docs/http-contract.md: it claims the key, lends the handler the
//!   request's transaction as a [`Tx`], and stores the response in that
//!   transaction, so that the business writes and the stored response
//!   commit together.
//! - [`claim`], [`Owner::complete`], [`Owner::release`], [`Owner::extend`],
//!   [`Owner::checkpoint`], [`lookup`]: the SQL API with typed outcomes, and
//!   [`Error::ClaimLost`] for IK001.
//! - [`fingerprint`]: the request hash, equal to `idempotency.fingerprint()`.
//! - [`Pool`]: a small connection pool on tokio-postgres.

mod body;
mod client;
mod error;
mod fingerprint;
mod key;
mod layer;
mod pool;
mod problem;

pub use body::ResponseBody;
pub use client::{claim, lookup, ClaimOptions, Completion, Outcome, Owner, Record, State, StoredResponse};
pub use error::Error;
pub use fingerprint::fingerprint;
pub use key::{parse_key, IDEMPOTENCY_KEY};
pub use layer::{credential_scope, Idempotency, IdempotencyLayer};
pub use pool::{Pool, PooledClient, Tx, TxClient};
pub use tokio_postgres;

/// The Rust snippets of README.md, compiled by `cargo test`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
