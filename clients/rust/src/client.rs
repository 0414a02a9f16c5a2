//! The SQL API of the extension over tokio-postgres: `claim`, then, as the
//! owner, `complete`, `release`, `extend` or `checkpoint`; `lookup` reads.
//!
//! Every function takes any `GenericClient` (a `Client` or a `Transaction`),
//! so the caller decides which transaction a call joins: `complete` belongs
//! in the transaction of the business writes, `claim` in one of its own.

use std::time::{Duration, SystemTime};

use serde_json::{Map, Value};
use tokio_postgres::{GenericClient, Row};

use crate::Error;

const CLAIM: &str = "SELECT outcome, fence, attempt, status_code, headers, body, recovery_point,
        recovery_state, retry_after, created_at
   FROM idempotency.claim($1, $2, $3, $4::text::interval, $5::text::interval, $6::text::interval)";
const COMPLETE: &str = "SELECT idempotency.complete($1, $2, $3, $4, $5, $6)";
const RELEASE: &str = "SELECT idempotency.release($1, $2, $3)";
const EXTEND: &str = "SELECT idempotency.extend($1, $2, $3::text::interval, $4)";
const CHECKPOINT: &str = "SELECT idempotency.checkpoint($1, $2, $3, $4, $5)";
const LOOKUP: &str = "SELECT scope, key, fingerprint, state, attempt,
        (extract(epoch FROM lease) * 1000000)::int8, lease_expires_at, recovery_point,
        recovery_state, status_code, headers, body, created_at, completed_at, expires_at
   FROM idempotency.lookup($1, $2)";

/// How to claim; every field left `None` takes the database's setting.
#[derive(Clone, Debug, Default)]
pub struct ClaimOptions {
    /// Whose key it is; `None`: the setting `idempotency.scope` (`''` when unset).
    pub scope: Option<String>,
    /// How long the owner may run before a retry may take over (`idempotency.lease`, 60 s).
    pub lease: Option<Duration>,
    /// How long the record answers retries (`idempotency.retention`, 24 h).
    pub retention: Option<Duration>,
    /// When the key is in progress, how long to wait for its owner before answering.
    pub wait: Option<Duration>,
}

/// What a claim decided.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The caller owns the key: run the work, then complete or release.
    New(Owner),
    /// A completed record of the same request: answer its response again.
    Replay { response: StoredResponse, created_at: SystemTime },
    /// A live owner holds the lease: ask for a retry after this many seconds (at least 1).
    InProgress { retry_after: u32 },
    /// The key belongs to a different request.
    Mismatch { created_at: SystemTime },
}

/// A response as the extension stores and replays it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code, 100..599.
    pub status_code: u16,
    /// Header names and values in order; a name may repeat.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

/// The claim that won: what proves ownership to complete, release, extend and checkpoint.
#[derive(Clone, Debug)]
pub struct Owner {
    /// The Idempotency-Key.
    pub key: String,
    /// The scope as claimed (`None`: the setting `idempotency.scope`).
    pub scope: Option<String>,
    /// The fencing token: larger on every claim and takeover.
    pub fence: i64,
    /// 1 on the first claim, +1 on every takeover of an abandoned lease.
    pub attempt: i32,
    /// What an earlier attempt saved with `checkpoint`, handed to a takeover.
    pub recovery_point: Option<String>,
    /// The state saved with that recovery point.
    pub recovery_state: Option<Value>,
}

/// What `complete` did with the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Stored: retries replay it.
    Stored,
    /// A 5xx released the key (unless `idempotency.store_server_errors`): the next retry runs again.
    Released,
}

/// Whether a record's work is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// An owner holds (or held) the lease.
    InProgress,
    /// The response is stored.
    Completed,
}

/// A record as `lookup` shows it: everything but the fence.
#[derive(Clone, Debug)]
pub struct Record {
    pub scope: String,
    pub key: String,
    pub fingerprint: Vec<u8>,
    pub state: State,
    pub attempt: i32,
    /// While in progress: the lease length the claim asked for (`None` once completed).
    pub lease: Option<Duration>,
    /// While in progress: when the owner is presumed dead.
    pub lease_expires_at: Option<SystemTime>,
    pub recovery_point: Option<String>,
    pub recovery_state: Option<Value>,
    /// The stored response, once completed.
    pub response: Option<StoredResponse>,
    pub created_at: SystemTime,
    pub completed_at: Option<SystemTime>,
    pub expires_at: SystemTime,
}

/// Claims `key` for the request whose fingerprint is given (see [`crate::fingerprint`]).
/// Run it outside the business transaction, so that it commits at once and a
/// concurrent retry sees it.
pub async fn claim<C>(db: &C, key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<Outcome, Error>
where
    C: GenericClient + Sync,
{
    let row = db
        .query_one(
            CLAIM,
            &[
                &key,
                &fingerprint,
                &options.scope,
                &options.lease.map(interval),
                &options.retention.map(interval),
                &options.wait.map(interval),
            ],
        )
        .await?;
    let outcome: &str = row.try_get(0)?;
    Ok(match outcome {
        "new" => Outcome::New(Owner {
            key: key.to_owned(),
            scope: options.scope.clone(),
            fence: row.try_get(1)?,
            attempt: row.try_get(2)?,
            recovery_point: row.try_get(6)?,
            recovery_state: row.try_get(7)?,
        }),
        "replay" => Outcome::Replay {
            response: stored_response(&row, 3)?.unwrap_or_default(),
            created_at: row.try_get(9)?,
        },
        "in_progress" => Outcome::InProgress {
            retry_after: row.try_get::<_, Option<i32>>(8)?.unwrap_or(1).max(1) as u32,
        },
        _ => Outcome::Mismatch { created_at: row.try_get(9)? },
    })
}

/// Reads a record as a claim would see it; `None` when there is none (or it expired).
pub async fn lookup<C>(db: &C, key: &str, scope: Option<&str>) -> Result<Option<Record>, Error>
where
    C: GenericClient + Sync,
{
    let row = match db.query_opt(LOOKUP, &[&key, &scope]).await? {
        None => return Ok(None),
        Some(row) => row,
    };
    let state: &str = row.try_get(3)?;
    Ok(Some(Record {
        scope: row.try_get(0)?,
        key: row.try_get(1)?,
        fingerprint: row.try_get(2)?,
        state: if state == "completed" { State::Completed } else { State::InProgress },
        attempt: row.try_get(4)?,
        lease: row.try_get::<_, Option<i64>>(5)?.map(|us| Duration::from_micros(us.max(0) as u64)),
        lease_expires_at: row.try_get(6)?,
        recovery_point: row.try_get(7)?,
        recovery_state: row.try_get(8)?,
        response: stored_response(&row, 9)?,
        created_at: row.try_get(12)?,
        completed_at: row.try_get(13)?,
        expires_at: row.try_get(14)?,
    }))
}

impl Owner {
    /// Stores the response and ends the claim, in the transaction of `db`:
    /// call it in the transaction of the business writes, so that both commit
    /// together. `Err(Error::ClaimLost)` when a retry took the claim over:
    /// then roll that transaction back.
    pub async fn complete<C>(
        &self,
        db: &C,
        status_code: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Completion, Error>
    where
        C: GenericClient + Sync,
    {
        let row = db
            .query_one(
                COMPLETE,
                &[&self.key, &self.fence, &i32::from(status_code), &body, &headers_json(headers), &self.scope],
            )
            .await?;
        let done: &str = row.try_get(0)?;
        Ok(if done == "released" { Completion::Released } else { Completion::Stored })
    }

    /// Deletes the claim so that the next retry runs again (the work failed
    /// before any side effect). `false` when this fence no longer owns it.
    pub async fn release<C>(&self, db: &C) -> Result<bool, Error>
    where
        C: GenericClient + Sync,
    {
        Ok(db.query_one(RELEASE, &[&self.key, &self.fence, &self.scope]).await?.try_get(0)?)
    }

    /// Renews the lease by `lease` (`None`: the claim's own lease length);
    /// returns its new end. Commit it on its own for others to see it.
    pub async fn extend<C>(&self, db: &C, lease: Option<Duration>) -> Result<SystemTime, Error>
    where
        C: GenericClient + Sync,
    {
        let row = db.query_one(EXTEND, &[&self.key, &self.fence, &lease.map(interval), &self.scope]).await?;
        Ok(row.try_get(0)?)
    }

    /// Saves the progress of multi-step work and renews the lease; a takeover
    /// gets `recovery_point` and `recovery_state` in its [`Owner`].
    pub async fn checkpoint<C>(&self, db: &C, recovery_point: &str, recovery_state: Option<&Value>) -> Result<(), Error>
    where
        C: GenericClient + Sync,
    {
        db.query_one(CHECKPOINT, &[&self.key, &self.fence, &recovery_point, &recovery_state, &self.scope])
            .await?;
        Ok(())
    }
}

/// Writes a duration as an interval PostgreSQL reads exactly.
fn interval(duration: Duration) -> String {
    format!("{} microseconds", duration.as_micros())
}

/// The stored response in columns status_code, headers, body from `first`; None without a status.
fn stored_response(row: &Row, first: usize) -> Result<Option<StoredResponse>, Error> {
    let status_code: Option<i32> = row.try_get(first)?;
    let headers: Option<Value> = row.try_get(first + 1)?;
    let body: Option<Vec<u8>> = row.try_get(first + 2)?;
    Ok(status_code.map(|code| StoredResponse {
        status_code: code as u16,
        headers: headers.as_ref().map(headers_from_json).unwrap_or_default(),
        body: body.unwrap_or_default(),
    }))
}

/// Writes headers as the extension stores them: an object of strings, or of
/// arrays of strings for a name that repeats.
fn headers_json(headers: &[(&str, &str)]) -> Value {
    let mut object = Map::new();
    for &(name, value) in headers {
        match object.get_mut(name) {
            None => {
                object.insert(name.to_owned(), Value::from(value));
            }
            Some(Value::Array(values)) => values.push(Value::from(value)),
            Some(first) => *first = Value::Array(vec![first.take(), Value::from(value)]),
        }
    }
    Value::Object(object)
}

/// Reads stored headers back as name-value pairs.
fn headers_from_json(headers: &Value) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for (name, value) in headers.as_object().into_iter().flatten() {
        let values = match value {
            Value::Array(values) => values.iter().collect(),
            single => vec![single],
        };
        pairs.extend(values.into_iter().filter_map(Value::as_str).map(|v| (name.clone(), v.to_owned())));
    }
    pairs
}
