//! The SQL API of the extension over SQLx: `claim`, then, as the owner,
//! `complete`, `release`, `extend` or `checkpoint`; `lookup` reads.
//!
//! Every function takes any SQLx executor on PostgreSQL (`&PgPool`,
//! `&mut *transaction`, `&mut *connection`), so the caller decides which
//! transaction a call joins: `complete` belongs in the transaction of the
//! business writes, `claim` in one of its own. Each call is one
//! simple-protocol query with its arguments as literals (see `sql`): one
//! round trip, nothing prepared, so it works through a transaction pooler.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use sqlx::error::BoxDynError;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgRow, PgTypeInfo, PgValueFormat, PgValueRef};
use sqlx::{Column, Executor, Postgres, Row, TypeInfo};
use uuid::Uuid;

use crate::Error;
use crate::sql;
use crate::telemetry::{call_span, traced};

/// The columns a claim answers; times come back as microseconds since the
/// epoch (no date crate needed), bytes as hex text: these queries answer in
/// text, where bytea follows the server's `bytea_output` (a DBA may set
/// `escape`), and `encode` does not.
const CLAIM_COLUMNS: &str = "outcome, fence, attempt, status_code, headers, encode(body, 'hex'), recovery_point, recovery_state,
        retry_after, (extract(epoch FROM created_at) * 1000000)::int8";
const LOOKUP_COLUMNS: &str = "scope, key, encode(fingerprint, 'hex'), state, attempt,
        (extract(epoch FROM lease) * 1000000)::int8, (extract(epoch FROM lease_expires_at) * 1000000)::int8,
        recovery_point, recovery_state, status_code, headers, encode(body, 'hex'),
        (extract(epoch FROM created_at) * 1000000)::int8, (extract(epoch FROM completed_at) * 1000000)::int8,
        (extract(epoch FROM expires_at) * 1000000)::int8";

/// The text of a claim (the token only when given: extension 1.2).
pub(crate) fn claim_sql(key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<String, Error> {
    let token = match options.token {
        Some(token) => format!(", token => {}", sql::uuid(Some(token))),
        None => String::new(),
    };
    Ok(format!(
        "SELECT {CLAIM_COLUMNS} FROM idempotency.claim({}, {}, {}, {}, {}, {}{token})",
        sql::text(Some(key), "text")?,
        sql::bytea(Some(fingerprint)),
        sql::text(options.scope.as_deref(), "text")?,
        sql::interval(options.lease),
        sql::interval(options.retention),
        sql::interval(options.wait),
    ))
}

/// The claim with its arguments bound, for a statement SQLx prepares once per
/// connection (the layer's `prepare`): the columns of [`claim_sql`] in the
/// same order, but the body and the creation time as stored, which such a
/// statement answers in binary (no `bytea_output` to follow, and nothing for
/// the server to convert: `bytes` and `time_at` read either form).
const CLAIM_BOUND: &str = "SELECT outcome, fence, attempt, status_code, headers, body, recovery_point, recovery_state,
        retry_after, created_at
    FROM idempotency.claim($1::text, $2::bytea, $3::text, $4::interval, $5::interval, $6::interval, token => $7::uuid)";

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
    /// This attempt's id (extension 1.2): a claim asked again with the
    /// token of the live owner answers `new` again with the same fence, so
    /// a claim (or a COMMIT) whose answer was lost can be asked again.
    pub token: Option<Uuid>,
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
/// Run it outside the business transaction (on the pool), so that it
/// commits at once and a concurrent retry sees it.
pub async fn claim<'c, E>(db: E, key: &str, fingerprint: &[u8], options: &ClaimOptions) -> Result<Outcome, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    claim_as(db, key, fingerprint, options, false).await
}

/// Claims as [`claim`] does; with `prepared`, as a statement with bound
/// arguments that SQLx prepares once per connection (one round trip a call
/// once prepared, but only where named statements live: see the layer's
/// `prepare`).
pub(crate) async fn claim_as<'c, E>(db: E, key: &str, fingerprint: &[u8], options: &ClaimOptions, prepared: bool) -> Result<Outcome, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let call = async {
        let row = if prepared {
            sqlx::query(CLAIM_BOUND)
                .bind(key)
                .bind(fingerprint)
                .bind(options.scope.as_deref())
                .bind(options.lease)
                .bind(options.retention)
                .bind(options.wait)
                .bind(options.token)
                .fetch_one(db)
                .await?
        } else {
            db.fetch_one(sqlx::raw_sql(&claim_sql(key, fingerprint, options)?)).await?
        };
        outcome_of(&row, key, options)
    };
    traced(call_span!("idempotency.claim", key), call, |outcome, span| {
        span.record("idempotency.outcome", outcome.name());
        if let Outcome::New(owner) = outcome {
            span.record("idempotency.attempt", owner.attempt);
        }
    })
    .await
}

/// What the claim's row says.
pub(crate) fn outcome_of(row: &PgRow, key: &str, options: &ClaimOptions) -> Result<Outcome, Error> {
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
            response: stored_response(row, 3)?.unwrap_or_default(),
            created_at: time_at(row, 9)?,
        },
        "in_progress" => Outcome::InProgress {
            retry_after: row.try_get::<Option<i32>, _>(8)?.unwrap_or(1).max(1) as u32,
        },
        _ => Outcome::Mismatch { created_at: time_at(row, 9)? },
    })
}

impl Outcome {
    /// The extension's name of the outcome: `new`, `replay`, `in_progress` or `mismatch`.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::New(_) => "new",
            Outcome::Replay { .. } => "replay",
            Outcome::InProgress { .. } => "in_progress",
            Outcome::Mismatch { .. } => "mismatch",
        }
    }
}

/// Reads a record as a claim would see it; `None` when there is none (or it expired).
pub async fn lookup<'c, E>(db: E, key: &str, scope: Option<&str>) -> Result<Option<Record>, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let text = format!(
        "SELECT {LOOKUP_COLUMNS} FROM idempotency.lookup({}, {})",
        sql::text(Some(key), "text")?,
        sql::text(scope, "text")?
    );
    let row = match db.fetch_optional(sqlx::raw_sql(&text)).await? {
        None => return Ok(None),
        Some(row) => row,
    };
    let state: &str = row.try_get(3)?;
    Ok(Some(Record {
        scope: row.try_get(0)?,
        key: row.try_get(1)?,
        fingerprint: bytes(&row, 2)?.unwrap_or_default(),
        state: if state == "completed" { State::Completed } else { State::InProgress },
        attempt: row.try_get(4)?,
        lease: row.try_get::<Option<i64>, _>(5)?.map(|us| Duration::from_micros(us.max(0) as u64)),
        lease_expires_at: row.try_get::<Option<i64>, _>(6)?.map(time),
        recovery_point: row.try_get(7)?,
        recovery_state: row.try_get(8)?,
        response: stored_response(&row, 9)?,
        created_at: time(row.try_get(12)?),
        completed_at: row.try_get::<Option<i64>, _>(13)?.map(time),
        expires_at: time(row.try_get(14)?),
    }))
}

impl Owner {
    /// Stores the response and ends the claim, in the transaction of `db`:
    /// call it in the transaction of the business writes (`&mut *tx`), so
    /// that both commit together. `Err(Error::ClaimLost)` when a retry took
    /// the claim over: then roll that transaction back.
    pub async fn complete<'c, E>(&self, db: E, status_code: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<Completion, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        self.complete_as(db, status_code, headers, body, false).await
    }

    /// Completes as [`Owner::complete`] does; with `prepared`, in a
    /// statement SQLx prepares once per connection (see the layer's `prepare`).
    pub(crate) async fn complete_as<'c, E>(&self, db: E, status_code: u16, headers: &[(&str, &str)], body: &[u8], prepared: bool) -> Result<Completion, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        // Bound, not literal: the body never enters the statement's text (which
        // SQLx logs). Unnamed unless `prepared` (parsed and described in one
        // round trip, run in a second), which is safe through a transaction
        // pooler inside a transaction, where complete belongs.
        let call = async {
            let done: String = sqlx::query_scalar(
                "SELECT idempotency.complete($1::text, $2::int8, $3::int4, $4::bytea, $5::jsonb, $6::text)",
            )
            .bind(&self.key)
            .bind(self.fence)
            .bind(i32::from(status_code))
            .bind(body)
            .bind(headers_json(headers))
            .bind(self.scope.as_deref())
            .persistent(prepared)
            .fetch_one(db)
            .await?;
            Ok(if done == "released" { Completion::Released } else { Completion::Stored })
        };
        traced(self.span(call_span!("idempotency.complete", &self.key)), call, |done, span| {
            span.record("idempotency.outcome", if *done == Completion::Released { "released" } else { "stored" });
        })
        .await
    }

    /// Deletes the claim so that the next retry runs again (the work failed
    /// before any side effect). `false` when this fence no longer owns it.
    pub async fn release<'c, E>(&self, db: E) -> Result<bool, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let call = async {
            let text = format!(
                "SELECT idempotency.release({}, {}::int8, {})",
                sql::text(Some(&self.key), "text")?,
                self.fence,
                sql::text(self.scope.as_deref(), "text")?
            );
            Ok(db.fetch_one(sqlx::raw_sql(&text)).await?.try_get(0)?)
        };
        traced(self.span(call_span!("idempotency.release", &self.key)), call, |released, span| {
            span.record("idempotency.outcome", if *released { "released" } else { "not_owned" });
        })
        .await
    }

    /// Renews the lease by `lease` (`None`: the claim's own lease length);
    /// returns its new end. Commit it on its own for others to see it.
    pub async fn extend<'c, E>(&self, db: E, lease: Option<Duration>) -> Result<SystemTime, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let text = format!(
            "SELECT (extract(epoch FROM idempotency.extend({}, {}::int8, {}, {})) * 1000000)::int8",
            sql::text(Some(&self.key), "text")?,
            self.fence,
            sql::interval(lease),
            sql::text(self.scope.as_deref(), "text")?
        );
        Ok(time(db.fetch_one(sqlx::raw_sql(&text)).await?.try_get(0)?))
    }

    /// Saves the progress of multi-step work and renews the lease; a takeover
    /// gets `recovery_point` and `recovery_state` in its [`Owner`].
    pub async fn checkpoint<'c, E>(&self, db: E, recovery_point: &str, recovery_state: Option<&Value>) -> Result<(), Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let text = format!(
            "SELECT idempotency.checkpoint({}, {}::int8, {}, {}, {})::text",
            sql::text(Some(&self.key), "text")?,
            self.fence,
            sql::text(Some(recovery_point), "text")?,
            sql::jsonb(recovery_state)?,
            sql::text(self.scope.as_deref(), "text")?
        );
        db.fetch_one(sqlx::raw_sql(&text)).await?;
        Ok(())
    }

    /// The span of a call as this owner: with its attempt.
    fn span(&self, span: tracing::Span) -> tracing::Span {
        span.record("idempotency.attempt", self.attempt);
        span
    }
}

/// A time the database gave as microseconds since the epoch.
fn time(micros: i64) -> SystemTime {
    let magnitude = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 { UNIX_EPOCH + magnitude } else { UNIX_EPOCH - magnitude }
}

/// Whether column `index` of `row` is of the built-in type named `name` (as SQLx spells it).
fn column_is(row: &PgRow, index: usize, name: &str) -> bool {
    row.columns().get(index).is_some_and(|column| column.type_info().name() == name)
}

/// A time column: a timestamptz as a prepared claim answers it, or the
/// microseconds since the epoch that the text queries select.
fn time_at(row: &PgRow, index: usize) -> Result<SystemTime, Error> {
    if column_is(row, index, "TIMESTAMPTZ") {
        return Ok(time(row.try_get::<UnixMicros, _>(index)?.0));
    }
    Ok(time(row.try_get(index)?))
}

/// A timestamptz read in binary, as microseconds since the Unix epoch
/// (PostgreSQL sends them since 2000-01-01); no date crate needed.
struct UnixMicros(i64);

/// The microseconds from the Unix epoch to PostgreSQL's, 2000-01-01.
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

impl sqlx::Type<Postgres> for UnixMicros {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(1184))
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for UnixMicros {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        match value.format() {
            PgValueFormat::Binary => {
                let since_2000 = i64::from_be_bytes(value.as_bytes()?.try_into()?);
                Ok(UnixMicros(since_2000.saturating_add(POSTGRES_EPOCH_MICROS)))
            }
            PgValueFormat::Text => Err("a timestamptz in text: select it as microseconds".into()),
        }
    }
}

/// The stored response in columns status_code, headers, body from `first`; None without a status.
fn stored_response(row: &PgRow, first: usize) -> Result<Option<StoredResponse>, Error> {
    let status_code: Option<i32> = row.try_get(first)?;
    let headers: Option<Value> = row.try_get(first + 1)?;
    let body = bytes(row, first + 2)?;
    Ok(status_code.map(|code| StoredResponse {
        status_code: code as u16,
        headers: headers.as_ref().map(headers_from_json).unwrap_or_default(),
        body: body.unwrap_or_default(),
    }))
}

/// The bytes of a column: a bytea as a prepared claim answers it (binary),
/// or text selected as `encode(..., 'hex')`.
fn bytes(row: &PgRow, index: usize) -> Result<Option<Vec<u8>>, Error> {
    if column_is(row, index, "BYTEA") {
        return Ok(row.try_get(index)?);
    }
    let hex: Option<&str> = row.try_get(index)?;
    hex.map(|hex| {
        sql::from_hex(hex).ok_or_else(|| Error::Database(sqlx::Error::Decode(format!("column {index} is not hex").into())))
    })
    .transpose()
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

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::PgPool;

    /// A replay and a mismatch read the same from a prepared claim (binary
    /// columns) as from a text one: the body byte for byte, the creation
    /// time to the microsecond.
    #[tokio::test]
    async fn a_prepared_claim_reads_what_a_text_claim_reads() {
        let url = std::env::var("DATABASE_URL").expect("DATABASE_URL: a database with CREATE EXTENSION idempotency");
        let pool = PgPool::connect(&url).await.unwrap();
        let key = format!("prepared-read-{}", Uuid::new_v4());
        let options = ClaimOptions::default();
        let Outcome::New(owner) = claim(&pool, &key, b"first", &options).await.unwrap() else {
            panic!("a fresh key is new");
        };
        let body = [0, 0xff, b'\\', b'x', 0x80];
        owner.complete(&pool, 201, &[("content-type", "application/octet-stream")], &body).await.unwrap();
        let created = lookup(&pool, &key, None).await.unwrap().expect("the record").created_at;
        for prepared in [false, true] {
            match claim_as(&pool, &key, b"first", &options, prepared).await.unwrap() {
                Outcome::Replay { response, created_at } => {
                    assert_eq!((response.status_code, &response.body[..]), (201, &body[..]), "prepared: {prepared}");
                    assert_eq!(created_at, created, "prepared: {prepared}");
                }
                other => panic!("a replay, not {other:?}"),
            }
            match claim_as(&pool, &key, b"other", &options, prepared).await.unwrap() {
                Outcome::Mismatch { created_at } => assert_eq!(created_at, created, "prepared: {prepared}"),
                other => panic!("a mismatch, not {other:?}"),
            }
        }
    }
}
