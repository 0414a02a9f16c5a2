//! The error of every database call, sorted by what the caller does next.

use std::fmt;

/// Why a call into the extension failed.
#[derive(Debug)]
pub enum Error {
    /// IK001: the fence no longer owns the claim (a retry took it over after
    /// the lease ended, or it was released, completed or reaped). Nothing
    /// changed; roll back the transaction the call ran in.
    ClaimLost(sqlx::Error),
    /// 22004 or 22023: an argument the extension refuses (an empty or too
    /// long key, a status code outside 100..599, a lease that is not positive...).
    InvalidArgument(sqlx::Error),
    /// 54000: a response over `idempotency.max_response_bytes`; the claim stays as it was.
    TooLarge(sqlx::Error),
    /// Anything else: the connection, the server, a missing extension or privilege.
    Database(sqlx::Error),
    /// The request's transaction was used after the response was sent.
    TransactionEnded,
    /// The `Tx` extractor on a route that is not behind the layer.
    NotGuarded,
}

impl Error {
    /// The SQLSTATE the server answered, if it answered one.
    pub fn sqlstate(&self) -> Option<String> {
        match self.source_error()? {
            sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
            _ => None,
        }
    }

    /// True when the server's answer never arrived (the connection broke,
    /// the server is shutting down, or no connection could be had): the call
    /// may or may not have run, and asking again on another connection is
    /// how to find out.
    pub fn is_connection(&self) -> bool {
        match self.source_error() {
            Some(
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed,
            ) => true,
            // Connection exceptions (08) and the server shutting down (57P01..57P03).
            Some(sqlx::Error::Database(_)) => {
                self.sqlstate().is_some_and(|code| code.starts_with("08") || code.starts_with("57P0"))
            }
            _ => false,
        }
    }

    /// The SQLx error underneath, if any.
    fn source_error(&self) -> Option<&sqlx::Error> {
        match self {
            Error::ClaimLost(err) | Error::InvalidArgument(err) | Error::TooLarge(err) | Error::Database(err) => {
                Some(err)
            }
            Error::TransactionEnded | Error::NotGuarded => None,
        }
    }
}

impl From<sqlx::Error> for Error {
    /// Sorts a database error by its SQLSTATE.
    fn from(err: sqlx::Error) -> Error {
        let code = match &err {
            sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
            _ => None,
        };
        match code.as_deref() {
            Some("IK001") => Error::ClaimLost(err),
            Some("22004" | "22023") => Error::InvalidArgument(err),
            Some("54000") => Error::TooLarge(err),
            _ => Error::Database(err),
        }
    }
}

impl Error {
    /// What failed, in a few words.
    fn what(&self) -> &'static str {
        match self {
            Error::ClaimLost(_) => "the claim was lost",
            Error::InvalidArgument(_) => "invalid argument",
            Error::TooLarge(_) => "the response is too large to store",
            Error::Database(_) => "database error",
            Error::TransactionEnded => "the request's transaction has ended",
            Error::NotGuarded => "this route is not behind pg_idempotency::IdempotencyLayer",
        }
    }

    /// The error for the layer's logs: the SQLSTATE instead of the server's
    /// message, which may quote a key or a scope.
    pub(crate) fn redacted(&self) -> String {
        match (self.source_error(), self.sqlstate()) {
            (Some(sqlx::Error::Database(_)), Some(code)) => format!("{} (SQLSTATE {code})", self.what()),
            (Some(sqlx::Error::Database(_)), None) => self.what().to_owned(),
            (Some(err), _) => format!("{}: {err}", self.what()),
            (None, _) => self.what().to_owned(),
        }
    }
}

impl fmt::Display for Error {
    /// Says what failed, then the server's message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source_error() {
            Some(sqlx::Error::Database(db)) => write!(f, "{}: {}", self.what(), db.message()),
            Some(err) => write!(f, "{}: {err}", self.what()),
            None => f.write_str(self.what()),
        }
    }
}

impl std::error::Error for Error {
    /// The SQLx error underneath.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source_error().map(|err| err as _)
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Error {
    /// An RFC 9457 problem: 409 `idempotency_claim_lost` for IK001, 503
    /// `idempotency_unavailable` for a database that failed (the layer rolls
    /// a 5xx back and frees the key), else 500 `idempotency_error`.
    fn into_response(self) -> axum_core::response::Response {
        tracing::error!("idempotency: {}", self.redacted());
        crate::problem::Problem::from(&self).response::<http_body_util::Full<bytes::Bytes>>().map(axum_core::body::Body::new)
    }
}
