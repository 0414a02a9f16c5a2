//! The flow that the layer and the idempotent function share: claiming
//! (asked again with the same token when its answer is lost), completing and
//! committing with the work, and freeing a key. A fix here lands in both.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use crate::telemetry::key_hash;
use crate::client::claim_as;
use crate::{ClaimOptions, Error, Outcome, Owner};

/// How often a claim whose answer was lost is asked, in all.
const CLAIM_ATTEMPTS: u32 = 4;

/// The pause before asking again the first time; it doubles each time.
const CLAIM_BACKOFF: Duration = Duration::from_millis(50);

/// How often the work may run for one call whose COMMIT's answer was lost.
pub(crate) const MAX_RUNS: u32 = 3;

/// Where the claims of one caller go: its pool, whether the claim is made
/// in the work's transaction, and whether claim and complete are prepared
/// statements.
#[derive(Clone, Copy)]
pub(crate) struct Flow<'a> {
    pub(crate) pool: &'a PgPool,
    pub(crate) one_transaction: bool,
    pub(crate) prepare: bool,
}

/// What a claim answered, with the transaction it was made in (one
/// transaction, `new` only) and whether it had to be asked again.
pub(crate) struct Claim {
    pub(crate) outcome: Outcome,
    pub(crate) transaction: Option<Transaction<'static, Postgres>>,
    pub(crate) asked_again: bool,
}

/// How `complete` and COMMIT ended.
pub(crate) enum Ended {
    /// The work and its stored result committed.
    Committed,
    /// A retry took the key over: the transaction was rolled back.
    ClaimLost,
    /// The connection broke before the COMMIT was sent: the server rolls back.
    LostBeforeCommit,
    /// The COMMIT was sent and its answer lost: claiming again with the token tells.
    LostAtCommit,
    /// `complete` failed otherwise: the transaction was rolled back, the key is still held.
    NotStored(Error),
    /// The server refused the COMMIT (a deferred constraint): it rolled back.
    Refused(Error),
}

impl Flow<'_> {
    /// Claims on a connection of the pool; a claim whose answer was lost is
    /// asked again (with the same token) on another connection. With
    /// `one_transaction`, the claim is made in a transaction, kept open for
    /// the work when it answers `new`.
    pub(crate) async fn claim(&self, key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<Claim, Error> {
        let mut attempt = 1;
        loop {
            let result = if self.one_transaction {
                self.begin_claim(key, fingerprint, options).await
            } else {
                self.claim_alone(key, fingerprint, options).await.map(|outcome| (outcome, None))
            };
            match result {
                Err(err) if answer_lost(&err) && attempt < CLAIM_ATTEMPTS => {
                    tracing::warn!("idempotency: the claim's answer was lost, asking again: {}", err.redacted());
                    tokio::time::sleep(CLAIM_BACKOFF * 2u32.pow(attempt - 1)).await;
                    attempt += 1;
                }
                result => {
                    return result.map(|(outcome, transaction)| Claim { outcome, transaction, asked_again: attempt > 1 });
                }
            }
        }
    }

    /// Claims on a connection of its own, committed at once.
    pub(crate) async fn claim_alone(&self, key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<Outcome, Error> {
        let mut conn = self.pool.acquire().await?;
        let result = claim_as(&mut *conn, key, fingerprint, options, self.prepare).await;
        if matches!(&result, Err(err) if err.is_connection()) {
            conn.close_on_drop();
        }
        result
    }

    /// Begins a transaction and claims in it; the transaction is kept only
    /// for a `new` (any other answer wrote nothing: it is rolled back
    /// without holding up the answer).
    async fn begin_claim(&self, key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<(Outcome, Option<Transaction<'static, Postgres>>), Error> {
        let mut transaction = self.pool.begin().await?;
        match claim_as(&mut *transaction, key, fingerprint, options, self.prepare).await? {
            outcome @ Outcome::New(_) => Ok((outcome, Some(transaction))),
            outcome => {
                tokio::spawn(async move {
                    let _ = transaction.rollback().await;
                });
                Ok((outcome, None))
            }
        }
    }

    /// Stores the result with `complete` in the work's transaction (when
    /// there is an owner) and commits both.
    pub(crate) async fn complete_and_commit(
        &self,
        mut transaction: Transaction<'static, Postgres>,
        owner: Option<&Owner>,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Ended {
        if let Some(owner) = owner {
            match owner.complete_as(&mut *transaction, status, headers, body, self.prepare).await {
                Ok(_) => {}
                Err(Error::ClaimLost(_)) => {
                    let _ = transaction.rollback().await;
                    return Ended::ClaimLost;
                }
                Err(err) if err.is_connection() => {
                    tracing::warn!("idempotency: the connection broke before COMMIT: {}", err.redacted());
                    return Ended::LostBeforeCommit;
                }
                Err(err) => {
                    tracing::error!("idempotency: could not store the response: {}", err.redacted());
                    let _ = transaction.rollback().await;
                    return Ended::NotStored(err);
                }
            }
        }
        match transaction.commit().await.map_err(Error::from) {
            Ok(()) => Ended::Committed,
            Err(err) if err.is_connection() => {
                tracing::warn!("idempotency: the answer to COMMIT was lost: {}", err.redacted());
                Ended::LostAtCommit
            }
            Err(err) => {
                tracing::error!("idempotency: COMMIT failed: {}", err.redacted());
                Ended::Refused(err)
            }
        }
    }

    /// Frees the key on a connection of the pool; its lease frees it otherwise.
    pub(crate) async fn release(&self, owner: &Owner) {
        if let Err(err) = owner.release(self.pool).await {
            tracing::error!(
                "idempotency: could not release key {}; it frees when its lease ends: {}",
                key_hash(&owner.key),
                err.redacted()
            );
        }
    }
}

/// True when a call reached a connection and its answer was lost (not when
/// no connection could be had: the pool already waited for one).
pub(crate) fn answer_lost(err: &Error) -> bool {
    err.is_connection() && !matches!(err, Error::Database(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed))
}

/// Frees the key of a run whose future is dropped before it ended (a
/// timeout outside, a panic), so that a retry runs at once instead of
/// waiting for the lease. Its transaction rolls back as it drops.
pub(crate) struct FreeOnDrop {
    pub(crate) pool: PgPool,
    pub(crate) owner: Option<Owner>,
}

impl Drop for FreeOnDrop {
    /// Releases the key in a task of its own.
    fn drop(&mut self) {
        let (Some(owner), Ok(runtime)) = (self.owner.take(), tokio::runtime::Handle::try_current()) else { return };
        let pool = self.pool.clone();
        tracing::warn!("idempotency: the request was dropped while its handler ran; freeing its key");
        runtime.spawn(async move {
            if let Err(err) = owner.release(&pool).await {
                tracing::error!(
                    "idempotency: could not free the key of a dropped request; it frees when its lease ends: {}",
                    err.redacted()
                );
            }
        });
    }
}
