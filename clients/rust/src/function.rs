//! The idempotent function: a unit of work (a key, in a scope) that runs
//! once. The work gets a [`Work`], whose transaction commits with its
//! stored result; a duplicate gets that result back (deserialized to the
//! work's type) without running, waits (`wait`) for a run in progress and
//! then fails with [`FunctionError::InProgress`]; an error frees the key
//! unless it is final (then it is stored, and duplicates get it back as
//! [`FunctionError::Stored`]). The claim, complete, token and round trips
//! are the layer's (the `flow` module).

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::flow::{Ended, FreeOnDrop, Flow, MAX_RUNS};
use crate::tx::Loan;
use crate::{ClaimOptions, Error, Outcome, Owner, StoredResponse, Tx, TxGuard, lookup};

/// The status code a result is stored with, and a final error.
const RESULT: u16 = 200;
const FAILURE: u16 = 400;

/// How long a duplicate waits, by default, for the run in progress.
pub const FUNCTION_WAIT: Duration = Duration::from_secs(2);

/// Which errors are final, over the work's error type.
type FinalFn = dyn Fn(&dyn Any) -> bool + Send + Sync;

/// An idempotent function's settings; [`Function::run`] runs a unit of work.
/// [`idempotent`] is `Function::new(pool).run(...)`. Make it once and clone
/// it (it is cheap): it reads the database's lease once.
#[derive(Clone)]
pub struct Function {
    pool: PgPool,
    scope: Option<String>,
    one_transaction: bool,
    prepare: bool,
    lease: Option<Duration>,
    retention: Option<Duration>,
    wait: Option<Duration>,
    extend_every: Option<Duration>,
    is_final: Option<Arc<FinalFn>>,
    /// The database's lease, read once (two transactions, no `lease` given).
    database_lease: Arc<OnceCell<Duration>>,
}

/// Runs `work` once for `key` and these arguments, with the defaults of [`Function::new`].
pub async fn idempotent<A, T, E, F, Fut>(pool: &PgPool, key: &str, args: &A, work: F) -> Result<T, FunctionError<E>>
where
    A: Serialize + ?Sized,
    T: Serialize + DeserializeOwned,
    E: fmt::Display + 'static,
    F: FnMut(Work) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    Function::new(pool.clone()).run(key, args, work).await
}

impl Function {
    /// The defaults: the scope, lease and retention the database's settings
    /// say, one transaction, a duplicate waits [`FUNCTION_WAIT`], no error is final.
    pub fn new(pool: PgPool) -> Function {
        Function {
            pool,
            scope: None,
            one_transaction: true,
            prepare: false,
            lease: None,
            retention: None,
            wait: Some(FUNCTION_WAIT),
            extend_every: None,
            is_final: None,
            database_lease: Arc::default(),
        }
    }

    /// Whose keys these are (`None`: the setting `idempotency.scope`).
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// `true` (the default): the claim, the work's writes and the stored
    /// result commit together. `false`: the claim commits first, for work
    /// that calls out of the database (a payment provider); the lease is
    /// then renewed while it runs, and [`Work::checkpoint`] commits at once.
    pub fn one_transaction(mut self, one_transaction: bool) -> Self {
        self.one_transaction = one_transaction;
        self
    }

    /// Whether the claim and `complete` are statements prepared once per
    /// connection, as [`IdempotencyLayer::prepare`](crate::IdempotencyLayer::prepare)
    /// says (off by default, for transaction poolers).
    pub fn prepare(mut self, prepare: bool) -> Self {
        self.prepare = prepare;
        self
    }

    /// How long a run may last before a duplicate may take its key over
    /// (default: the setting `idempotency.lease`).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long a result answers duplicates (default: the setting `idempotency.retention`).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// How long a duplicate waits for the run in progress before
    /// [`FunctionError::InProgress`] (zero: at once).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Two transactions: how often the lease is renewed while the work runs
    /// (default: a third of the lease).
    pub fn extend_every(mut self, every: Duration) -> Self {
        self.extend_every = Some(every);
        self
    }

    /// Which errors of the work are final: stored (their message), so that
    /// duplicates get [`FunctionError::Stored`] without running. Others
    /// free the key (the default for every error).
    pub fn final_errors<E: 'static>(mut self, is_final: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        self.is_final = Some(Arc::new(move |err: &dyn Any| err.downcast_ref::<E>().is_some_and(&is_final)));
        self
    }

    /// Runs `work` once for `key` and `args` (serialized to canonical JSON
    /// and hashed: the same key with other arguments is
    /// [`FunctionError::Mismatch`]); a duplicate gets the stored result.
    /// `work` runs again only when a COMMIT's answer was lost before it committed.
    pub async fn run<A, T, E, F, Fut>(&self, key: &str, args: &A, mut work: F) -> Result<T, FunctionError<E>>
    where
        A: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: fmt::Display + 'static,
        F: FnMut(Work) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let fingerprint = arguments_fingerprint(args)?;
        let options = ClaimOptions {
            scope: self.scope.clone(),
            lease: self.lease,
            retention: self.retention,
            wait: self.wait,
            token: Some(Uuid::new_v4()),
        };
        let mut lost = false;
        for _ in 0..MAX_RUNS {
            let claim = self.flow().claim(key, &fingerprint, &options).await?;
            let owner = match claim.outcome {
                Outcome::New(owner) => owner,
                Outcome::Replay { response, .. } => return stored_result(response),
                // A duplicate took over after the lease ended: nothing of this run committed.
                Outcome::InProgress { .. } if lost => return Err(FunctionError::ClaimLost),
                Outcome::InProgress { retry_after } => return Err(FunctionError::InProgress { retry_after }),
                Outcome::Mismatch { .. } => return Err(FunctionError::Mismatch),
            };
            match self.run_once(owner, claim.transaction, &mut work, &fingerprint, &options).await? {
                Some(value) => return Ok(value),
                None => {
                    tracing::warn!("idempotency: the function's COMMIT went unanswered; claiming again to learn whether it took effect");
                    lost = true;
                }
            }
        }
        Err(FunctionError::Idempotency(Error::Database(sqlx::Error::Protocol(
            "the connection was lost at every COMMIT of the function; nothing is known to have committed".into(),
        ))))
    }

    /// Runs the work once as `owner` and ends its transaction: complete and
    /// COMMIT, or on an error roll back and free the key (or store a final
    /// error). `None` when the COMMIT's answer was lost.
    async fn run_once<T, E, F, Fut>(
        &self,
        owner: Owner,
        begun: Option<Transaction<'static, Postgres>>,
        work: &mut F,
        fingerprint: &[u8],
        options: &ClaimOptions,
    ) -> Result<Option<T>, FunctionError<E>>
    where
        T: Serialize,
        E: fmt::Display + 'static,
        F: FnMut(Work) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // Dropped before the end (the caller gave up, a panic): the transaction
        // rolls back as it drops, and this frees the key (two transactions).
        let mut free_on_drop = FreeOnDrop { pool: self.pool.clone(), owner: Some(owner.clone()).filter(|_| !self.one_transaction) };
        let loan = Loan::new(self.pool.clone(), begun);
        let renewal = (!self.one_transaction).then(|| self.keep_leased(owner.clone()));
        let handed = Work { tx: loan.tx(), owner: owner.clone(), pool: self.pool.clone(), one_transaction: self.one_transaction };
        let result = work(handed).await;
        drop(renewal);
        let transaction = loan.end().await;
        free_on_drop.owner = None;
        let value = match result {
            Ok(value) => value,
            Err(err) => {
                if let Some(transaction) = transaction {
                    let _ = transaction.rollback().await;
                }
                self.fail(&owner, &err, fingerprint, options).await;
                return Err(FunctionError::Failed(err));
            }
        };
        let body = match serde_json::to_vec(&value) {
            Ok(body) => body,
            Err(err) => {
                drop(transaction);
                self.free(&owner).await;
                return Err(FunctionError::Serialization(err));
            }
        };
        let transaction = match transaction {
            Some(transaction) => transaction,
            None => self.pool.begin().await?,
        };
        match self.flow().complete_and_commit(transaction, Some(&owner), RESULT, &[], &body).await {
            Ended::Committed => Ok(Some(value)),
            Ended::ClaimLost => Err(FunctionError::ClaimLost),
            Ended::LostBeforeCommit | Ended::LostAtCommit => Ok(None),
            Ended::NotStored(err) | Ended::Refused(err) => {
                self.free(&owner).await;
                Err(FunctionError::Idempotency(err))
            }
        }
    }

    /// After the work failed with `err` (its writes rolled back): stores a
    /// final error, else frees the key. With one transaction the rollback
    /// undid the claim: a final error is claimed again (with the call's
    /// token) and completed in a transaction of its own.
    async fn fail<E: fmt::Display + 'static>(&self, owner: &Owner, err: &E, fingerprint: &[u8], options: &ClaimOptions) {
        if !self.is_final.as_ref().is_some_and(|is_final| is_final(err)) {
            return self.free(owner).await;
        }
        let body = serde_json::json!({ "error": err.to_string() }).to_string();
        let stored = async {
            let (owner, transaction) = if self.one_transaction {
                match self.flow().claim(&owner.key, fingerprint, options).await? {
                    crate::flow::Claim { outcome: Outcome::New(owner), transaction, .. } => (owner, transaction),
                    _ => return Ok(()), // nothing of this call is held
                }
            } else {
                (owner.clone(), None)
            };
            let transaction = match transaction {
                Some(transaction) => transaction,
                None => self.pool.begin().await?,
            };
            match self.flow().complete_and_commit(transaction, Some(&owner), FAILURE, &[], body.as_bytes()).await {
                Ended::NotStored(err) | Ended::Refused(err) => Err(err),
                _ => Ok(()),
            }
        };
        if let Err(err) = stored.await {
            tracing::error!("idempotency: could not store the function's final error: {}", err.redacted());
            self.free(owner).await;
        }
    }

    /// Frees the key of a run that failed (two transactions: one
    /// transaction's rollback already did).
    async fn free(&self, owner: &Owner) {
        if !self.one_transaction {
            self.flow().release(owner).await;
        }
    }

    /// Two transactions: renews the lease while the work runs (every
    /// `extend_every`, or a third of the lease: the `lease` given, or the
    /// database's, read from the first record and kept); stops when dropped.
    fn keep_leased(&self, owner: Owner) -> Renewal {
        let (pool, every, lease, database_lease) = (self.pool.clone(), self.extend_every, self.lease, self.database_lease.clone());
        Renewal(tokio::spawn(async move {
            let every = match (every, lease) {
                (Some(every), _) => every,
                (None, Some(lease)) => lease / 3,
                (None, None) => *database_lease.get_or_init(|| lease_of(&pool, &owner)).await / 3,
            };
            loop {
                tokio::time::sleep(every).await;
                match owner.extend(&pool, None).await {
                    Ok(_) => {}
                    Err(Error::ClaimLost(_)) => return, // complete will say so
                    Err(err) => tracing::warn!("idempotency: could not renew the lease: {}", err.redacted()),
                }
            }
        }))
    }

    /// Where this function's claims go.
    fn flow(&self) -> Flow<'_> {
        Flow { pool: &self.pool, one_transaction: self.one_transaction, prepare: self.prepare }
    }
}

/// The lease of the owner's record (60 s when it cannot be read).
async fn lease_of(pool: &PgPool, owner: &Owner) -> Duration {
    match lookup(pool, &owner.key, owner.scope.as_deref()).await {
        Ok(Some(record)) => record.lease.unwrap_or(Duration::from_secs(60)),
        _ => Duration::from_secs(60),
    }
}

/// The lease renewal task, stopped when dropped.
struct Renewal(JoinHandle<()>);

impl Drop for Renewal {
    /// Stops renewing.
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The result a replay carries, or the final error it stored.
fn stored_result<T: DeserializeOwned, E>(response: StoredResponse) -> Result<T, FunctionError<E>> {
    if response.status_code == FAILURE {
        let stored: Value = serde_json::from_slice(&response.body)?;
        let message = stored.get("error").and_then(Value::as_str).unwrap_or("the first run failed");
        return Err(FunctionError::Stored { message: message.to_owned() });
    }
    Ok(serde_json::from_slice(&response.body)?)
}

/// The fingerprint of a call's arguments: SHA-256 of a prefix and their
/// canonical JSON, the bytes every client of the project makes of the same
/// arguments (clients/testdata/function-fingerprints.json).
pub fn arguments_fingerprint<A: Serialize + ?Sized>(args: &A) -> Result<Vec<u8>, serde_json::Error> {
    let mut text = String::new();
    canonical_json(&serde_json::to_value(args)?, &mut text);
    Ok(Sha256::new().chain_update(b"pg-idempotency function\n").chain_update(text.as_bytes()).finalize().to_vec())
}

/// Writes `value` as canonical JSON: as JavaScript's `JSON.stringify`
/// writes it, with object keys sorted by UTF-16 code units and no whitespace.
fn canonical_json(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        Value::Object(object) => {
            let mut keys: Vec<&String> = object.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(key.as_str()).to_string());
                out.push(':');
                canonical_json(&object[key], out);
            }
            out.push('}');
        }
        Value::Number(number) => match number.as_f64() {
            Some(float) if number.is_f64() => out.push_str(&js_number(float)),
            _ => out.push_str(&number.to_string()),
        },
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// `x` as JavaScript writes a number (ECMAScript `Number::toString`): the
/// shortest digits that read back as `x`, without an exponent from 1e-6 up
/// to 1e21, an integral value without ".0".
fn js_number(x: f64) -> String {
    if x == 0.0 {
        return "0".to_owned();
    }
    // {:e} writes the shortest digits that read back as x: "1.5e300".
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').expect("{:e} writes an exponent");
    let digits = mantissa.replace('.', "");
    let k = digits.len() as i32;
    let n = exponent.parse::<i32>().expect("{:e} writes an integer exponent") + 1; // x = 0.digits * 10^n
    let text = if k <= n && n <= 21 {
        digits + &"0".repeat((n - k) as usize)
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat(-n as usize))
    } else {
        let point = if k > 1 { "." } else { "" };
        format!("{}{point}{}e{}{}", &digits[..1], &digits[1..], if n > 0 { '+' } else { '-' }, (n - 1).abs())
    };
    if x < 0.0 { format!("-{text}") } else { text }
}

/// What the work gets: its transaction (begun when first locked, or the
/// one the claim was made in), who it runs as, and what an earlier attempt
/// saved. Cheap to clone.
#[derive(Clone)]
pub struct Work {
    tx: Tx,
    owner: Owner,
    pool: PgPool,
    one_transaction: bool,
}

impl Work {
    /// The work's transaction, which commits with the stored result.
    pub fn tx(&self) -> &Tx {
        &self.tx
    }

    /// Locks the work's transaction: `query.execute(&mut *guard)`.
    pub async fn lock(&self) -> Result<TxGuard<'_>, Error> {
        self.tx.lock().await
    }

    /// The key this work runs under.
    pub fn key(&self) -> &str {
        &self.owner.key
    }

    /// 1 on the first run, +1 on every takeover of an abandoned lease.
    pub fn attempt(&self) -> i32 {
        self.owner.attempt
    }

    /// What an earlier attempt saved with [`Work::checkpoint`] (a takeover resumes from it).
    pub fn recovery_point(&self) -> Option<&str> {
        self.owner.recovery_point.as_deref()
    }

    /// The state saved with the recovery point.
    pub fn recovery_state(&self) -> Option<&Value> {
        self.owner.recovery_state.as_ref()
    }

    /// Saves a recovery point (and renews the lease). Two transactions: it
    /// commits at once, so that a takeover resumes after it; one
    /// transaction: it commits with the work.
    pub async fn checkpoint(&self, recovery_point: &str, recovery_state: Option<&Value>) -> Result<(), Error> {
        if self.one_transaction {
            let mut guard = self.tx.lock().await?;
            self.owner.checkpoint(&mut *guard, recovery_point, recovery_state).await
        } else {
            self.owner.checkpoint(&self.pool, recovery_point, recovery_state).await
        }
    }
}

/// Why an idempotent function gave no result.
#[derive(Debug)]
pub enum FunctionError<E> {
    /// The work failed with this error: its writes rolled back; the key was
    /// freed (a retry runs again), or, for a final error, stored.
    Failed(E),
    /// The first run failed with a final error (its message): a duplicate gets it back.
    Stored { message: String },
    /// Another run holds the key past the wait: retry after this many seconds.
    InProgress { retry_after: u32 },
    /// The key was used with other arguments.
    Mismatch,
    /// The lease ended and a duplicate took the key over: nothing of this run committed.
    ClaimLost,
    /// The arguments, the result or a stored result do not (de)serialize.
    Serialization(serde_json::Error),
    /// The database failed.
    Idempotency(Error),
}

impl<E> From<Error> for FunctionError<E> {
    /// A database error.
    fn from(err: Error) -> Self {
        match err {
            Error::ClaimLost(_) => FunctionError::ClaimLost,
            err => FunctionError::Idempotency(err),
        }
    }
}

impl<E> From<sqlx::Error> for FunctionError<E> {
    /// A database error.
    fn from(err: sqlx::Error) -> Self {
        Error::from(err).into()
    }
}

impl<E> From<serde_json::Error> for FunctionError<E> {
    /// A (de)serialization error.
    fn from(err: serde_json::Error) -> Self {
        FunctionError::Serialization(err)
    }
}

impl<E: fmt::Display> fmt::Display for FunctionError<E> {
    /// Says what happened.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FunctionError::Failed(err) => write!(f, "the idempotent function failed: {err}"),
            FunctionError::Stored { message } => write!(f, "the first run of this key failed: {message}"),
            FunctionError::InProgress { retry_after } => write!(f, "the key is in progress; retry in {retry_after} s"),
            FunctionError::Mismatch => f.write_str("the key was used with other arguments"),
            FunctionError::ClaimLost => f.write_str("the key was taken over after the lease ended; nothing of this run committed"),
            FunctionError::Serialization(err) => write!(f, "could not (de)serialize for the idempotent function: {err}"),
            FunctionError::Idempotency(err) => write!(f, "idempotency: {err}"),
        }
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for FunctionError<E> {}
