//! The tower `Layer`: Idempotency-Key on every POST and PATCH (by default),
//! as docs/http-contract.md says.
//!
//! For a covered request it reads the key and the body, claims the key on
//! a connection of the application's pool (that claim commits at once, so a
//! concurrent retry sees it), then lends the handler a transaction as a
//! [`Tx`] in the request's extensions, begun when the handler first uses
//! it. When the handler has finished, it buffers the response and, in that
//! transaction, stores it with `complete` and commits: the business writes
//! and the stored response commit together, or not at all. A response the
//! handler did not produce by finishing (a timeout layer's, a panic
//! handler's) rolls back and frees the key; so does this layer's future
//! dropped before the end (a timeout outside it).
//!
//! Each request gets a claim token. When the database's answer is lost (the
//! connection breaks), the layer claims again with that token on another
//! connection: the extension answers `new` with the same fence while the
//! claim is still this request's (run the handler again: nothing of it
//! committed), or `replay` once its COMMIT went through (send what the
//! handler answered, as stored).

use std::future::{Future, poll_fn};
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE, HeaderName, LOCATION};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, Transaction};
use tower::{Layer, Service};
use uuid::Uuid;

use crate::body::{BoxError, IdempotencyBody, RequestBody, ResponseBody};
use crate::problem::{Problem, replay};
use crate::flow::{Ended, FreeOnDrop, Flow, MAX_RUNS, answer_lost};
use crate::telemetry::key_hash;
use crate::tx::Loan;
use crate::{ClaimOptions, Error, Outcome, Owner, StoredResponse, fingerprint, key};

/// What the layer's service answers.
type Answer<B> = Response<ResponseBody<B>>;

/// Computes the scope of a request from its head.
type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;

/// Reads the key of a request from its head and body: `Ok(None)` when it has none.
type KeyFn = dyn Fn(&Parts, &[u8]) -> Result<Option<String>, &'static str> + Send + Sync;

/// Accepts a request (head and raw body) as authentic, or says why not.
type VerifyFn = dyn Fn(&Parts, &[u8]) -> Result<(), String> + Send + Sync;

/// Given the response to store, returns what to store instead.
type RedactFn = dyn Fn(StoredResponse) -> StoredResponse + Send + Sync;

/// How long, by default with [`IdempotencyLayer::one_transaction`], a
/// request waits for a running one with the same key (whose claim has not
/// committed yet) before answering 409.
pub const ONE_TRANSACTION_WAIT: Duration = Duration::from_secs(2);

/// A whole body.
pub(crate) fn full<B>(bytes: Bytes) -> ResponseBody<B> {
    IdempotencyBody::whole(bytes)
}

/// The layer: give it the application's `PgPool` (on the database of the
/// business data), set options with its builder methods, and put it in an
/// axum `Router` (`.layer(...)`) or around any tower service.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pool: PgPool,
    methods: Vec<Method>,
    key_required: bool,
    fail_open: bool,
    lease: Option<Duration>,
    retention: Option<Duration>,
    stored_headers: Vec<HeaderName>,
    max_body_bytes: usize,
    scope: Arc<ScopeFn>,
    one_transaction: bool,
    prepare: bool,
    wait: Option<Duration>,
    key: Option<Arc<KeyFn>>,
    verify: Option<Arc<VerifyFn>>,
    redact: Option<Arc<RedactFn>>,
}

impl IdempotencyLayer {
    /// A layer with the defaults: POST and PATCH, key required, fail closed,
    /// the database's lease and retention, Content-Type and Location stored,
    /// bodies up to 1 MiB, scope from the credential ([`credential_scope`]).
    pub fn new(pool: PgPool) -> IdempotencyLayer {
        IdempotencyLayer {
            pool,
            methods: vec![Method::POST, Method::PATCH],
            key_required: true,
            fail_open: false,
            lease: None,
            retention: None,
            stored_headers: vec![CONTENT_TYPE, LOCATION],
            max_body_bytes: 1 << 20,
            scope: Arc::new(credential_scope),
            one_transaction: false,
            prepare: false,
            wait: None,
            key: None,
            verify: None,
            redact: None,
        }
    }

    /// The methods that take a key; others pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Whether a covered request without a key is refused (400, the default)
    /// or runs unguarded (in a transaction, but without a record).
    pub fn key_required(mut self, required: bool) -> Self {
        self.key_required = required;
        self
    }

    /// When the database cannot be reached or a claim fails: `false` (the
    /// default) answers 503; `true` runs the handler unguarded, in a
    /// transaction when a connection is at hand, else without [`Tx`].
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// How long a handler may run before a retry may take its key over.
    /// Panics on zero (the extension would refuse every claim).
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(lease >= Duration::from_micros(1), "the idempotency lease must be positive");
        self.lease = Some(lease);
        self.check_retention();
        self
    }

    /// How long a record answers retries, counted from the first request.
    /// Panics when shorter than the lease (the extension would refuse every claim).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self.check_retention();
        self
    }

    /// The response headers that a replay repeats (the extension drops
    /// Set-Cookie and credentials whatever this says).
    pub fn store_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.stored_headers = names.into_iter().collect();
        self
    }

    /// The largest request body read (413 beyond).
    pub fn max_body_bytes(mut self, limit: usize) -> Self {
        self.max_body_bytes = limit;
        self
    }

    /// Who a key belongs to, from the request's head (its extensions hold
    /// what an authentication layer put there), for an application with
    /// its own notion of account or tenant.
    pub fn scope(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.scope = Arc::new(scope);
        self
    }

    /// Whether the claim is made in the handler's transaction (`true`), so
    /// that the claim, the handler's writes and the stored response commit
    /// together or not at all; or, by default (`false`), committed on its
    /// own before the handler runs. Only for handlers whose every effect is
    /// in this database: a payment provider called by the handler needs the
    /// default (see the README).
    pub fn one_transaction(mut self, one_transaction: bool) -> Self {
        self.one_transaction = one_transaction;
        self
    }

    /// Whether the claim and `complete` are sent as statements that SQLx
    /// prepares once per connection (`true`): one round trip each, not
    /// parsed and planned again on every call. Off by default, so that the
    /// layer works through any pooler: turn it on for direct connections, a
    /// session pooler, or PgBouncer 1.21 or later in transaction mode with
    /// `max_prepared_statements` set (before 1.21, a statement prepared on
    /// one server connection is missing on the next).
    pub fn prepare(mut self, prepare: bool) -> Self {
        self.prepare = prepare;
        self
    }

    /// How long a request waits for another with the same key that is
    /// still running, then answers 409 (claim's `wait`). Default: at once,
    /// or [`ONE_TRANSACTION_WAIT`] with [`one_transaction`](Self::one_transaction),
    /// where a duplicate cannot see the first's claim until it commits.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Where the key is, instead of the Idempotency-Key header: a function
    /// of the request's head and body, `Ok(None)` when it has none (then
    /// [`key_required`](Self::key_required) decides), `Err(why)` when it is
    /// malformed (400). E.g. [`body_key`] for a sender that keeps its event
    /// id in the body.
    pub fn key(mut self, key: impl Fn(&Parts, &[u8]) -> Result<Option<String>, &'static str> + Send + Sync + 'static) -> Self {
        self.key = Some(Arc::new(key));
        self
    }

    /// Checks that a covered request is authentic (a webhook's signature),
    /// from its head and raw body, before anything is claimed: `Err(why)`
    /// answers 401 `webhook_unverified` and leaves no record.
    pub fn verify(mut self, verify: impl Fn(&Parts, &[u8]) -> Result<(), String> + Send + Sync + 'static) -> Self {
        self.verify = Some(Arc::new(verify));
        self
    }

    /// A [Standard Webhooks](https://www.standardwebhooks.com) receiver:
    /// POST only, each delivery verified by `verify` (its raw body and
    /// headers: e.g. `Webhook::verify` of the `standardwebhooks` crate)
    /// before the claim, keyed by its `webhook-id`, and scoped by `sender`.
    pub fn standard_webhooks<E: std::fmt::Display>(
        self,
        verify: impl Fn(&[u8], &http::HeaderMap) -> Result<(), E> + Send + Sync + 'static,
        sender: &str,
    ) -> Self {
        let scope = format!("webhook:{sender}");
        self.methods([Method::POST])
            .verify(move |parts, body| verify(body, &parts.headers).map_err(|err| err.to_string()))
            .key(|parts, _| match parts.headers.get("webhook-id") {
                None => Ok(None),
                Some(id) => key::parse_key(id.as_bytes()).map(Some),
            })
            .scope(move |_| scope.clone())
    }

    /// What is stored of a response (and so what a replay sends), given
    /// the response to store (its stored headers): e.g. to drop a card
    /// number from the body. The live response is sent unchanged. A hook
    /// that panics is answered 500 `idempotency_redact_failed`: nothing is
    /// stored, the handler's work rolls back and the key is freed.
    pub fn redact(mut self, redact: impl Fn(StoredResponse) -> StoredResponse + Send + Sync + 'static) -> Self {
        self.redact = Some(Arc::new(redact));
        self
    }

    /// Panics when the retention is shorter than the lease.
    fn check_retention(&self) {
        if let (Some(lease), Some(retention)) = (self.lease, self.retention) {
            assert!(retention >= lease, "the idempotency retention must be at least the lease");
        }
    }
}

/// A key source for [`IdempotencyLayer::key`]: the string `field` of a
/// JSON object body (Stripe keeps its event id in `id`); none when the body
/// has no such field, malformed when it is not a string.
pub fn body_key(field: &'static str) -> impl Fn(&Parts, &[u8]) -> Result<Option<String>, &'static str> + Send + Sync + 'static {
    move |_, body| match serde_json::from_slice::<serde_json::Value>(body).ok().as_ref().and_then(|body| body.get(field)) {
        None => Ok(None),
        Some(serde_json::Value::String(key)) => key::parse_key(key.as_bytes()).map(Some),
        Some(_) => Err("The event id in the body is not a string."),
    }
}

/// The scope of a request: the lowercase hex SHA-256 of
/// `authorization:<Authorization>`, or else of `x-api-key:<X-API-Key>`, or
/// `""` when it has neither. The credential itself is never stored.
pub fn credential_scope(request: &Parts) -> String {
    for name in ["authorization", "x-api-key"] {
        if let Some(value) = request.headers.get(name) {
            let mut hash = Sha256::new();
            hash.update(name.as_bytes());
            hash.update(b":");
            hash.update(value.as_bytes());
            return hex::encode(hash.finalize());
        }
    }
    String::new()
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    /// Wraps the service.
    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency { inner, layer: Arc::new(self.clone()) }
    }
}

/// The service that [`IdempotencyLayer`] makes.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    layer: Arc<IdempotencyLayer>,
}

/// Any request body, as tower-http's layers take: the inner service gets a
/// [`RequestBody`] of it (axum's `Router` takes any body).
impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Answer<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Answer<ResBody>, S::Error>> + Send>>;

    /// Ready when the inner service is.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    /// Guards a covered request; passes the others through.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone is not ready: keep it, and use the one that was polled.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        if layer.methods.contains(request.method()) {
            Box::pin(async move { layer.guard(inner, request).await })
        } else {
            Box::pin(pass_through(inner, request.map(IdempotencyBody::streamed)))
        }
    }
}

/// A request read whole, which the handler can be given again.
struct Buffered {
    parts: Parts,
    body: Bytes,
}

impl Buffered {
    /// A new copy of the request.
    fn request<B>(&self) -> Request<RequestBody<B>> {
        Request::from_parts(self.parts.clone(), IdempotencyBody::whole(self.body.clone()))
    }
}

/// A request's claim that answered `new`: its owner, and what claims it again.
struct Claimed<'a> {
    owner: Owner,
    fingerprint: &'a [u8],
    options: &'a ClaimOptions,
}

/// How one run of the handler ended.
enum Run<B, E> {
    /// With this answer, to send.
    Answered(Result<Answer<B>, E>),
    /// The connection broke under the transaction: before the COMMIT was
    /// sent (`None`: the server rolls it back), or before its answer came
    /// (the handler's answer, to send if it committed). Claiming again with
    /// the token says which.
    Lost(Option<(response::Parts, Bytes)>),
}

impl IdempotencyLayer {
    /// Claims the request's key and answers: the handler's response, a
    /// replay, or a problem.
    async fn guard<S, ReqBody, ResBody>(&self, inner: S, request: Request<ReqBody>) -> Result<Answer<ResBody>, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone,
        ReqBody: Body,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        // The header's key is checked before the body is read; another source reads the body.
        let header_key = match self.key {
            Some(_) => None,
            None => match self.required(key::request_key(request.headers())) {
                Ok(key) => key,
                Err(problem) => return Ok(problem.response()),
            },
        };
        let (parts, body) = request.into_parts();
        let request = match read_body(body, self.max_body_bytes).await {
            Ok(body) => Buffered { parts, body },
            Err(problem) => return Ok(problem.response()),
        };
        if let Some(Err(why)) = self.verify.as_ref().map(|verify| verify(&request.parts, &request.body)) {
            tracing::warn!("idempotency: a request failed verification: {why}");
            return Ok(Problem::Unverified.response());
        }
        let key = match &self.key {
            None => header_key,
            Some(source) => match self.required(source(&request.parts, &request.body)) {
                Ok(key) => key,
                Err(problem) => return Ok(problem.response()),
            },
        };
        let Some(key) = key else {
            return self.run_answered(inner, &request).await;
        };
        let options = ClaimOptions {
            scope: Some((self.scope)(&request.parts)),
            lease: self.lease,
            retention: self.retention,
            wait: self.wait.or(Some(ONE_TRANSACTION_WAIT).filter(|_| self.one_transaction)),
            token: Some(Uuid::new_v4()),
        };
        let uri = &request.parts.uri;
        let body = Some(&request.body[..]).filter(|body| !body.is_empty());
        let query = uri.query().filter(|query| !query.is_empty());
        let request_fingerprint = fingerprint(request.parts.method.as_str(), uri.path(), body, query);

        // After a run whose connection broke: whether its COMMIT was sent,
        // with the handler's answer to send if it committed.
        let mut lost: Option<Option<(response::Parts, Bytes)>> = None;
        for _ in 0..MAX_RUNS {
            let claimed = self.flow().claim(&key, &request_fingerprint, &options).await;
            let (owner, transaction) = match claimed.map(|c| (c.outcome, c.transaction, c.asked_again)) {
                Ok((Outcome::New(owner), transaction, _)) => (owner, transaction),
                Ok((Outcome::Replay { response, .. }, _, _)) => {
                    return Ok(match lost.flatten() {
                        // It committed: the handler's answer is this request's first.
                        Some((head, body)) => Response::from_parts(head, full(body)),
                        None => replay(response),
                    });
                }
                // The lease ended and another request took over: this run rolled back.
                Ok((Outcome::InProgress { .. }, _, _)) if lost.is_some() => return Ok(Problem::ClaimLost.response()),
                // One transaction: after a claim whose answer was lost, the
                // key is most likely held by that claim's own transaction,
                // which never commits and lasts until the server learns its
                // connection is gone (half-open). Not a 409 for its own claim.
                Ok((Outcome::InProgress { retry_after }, _, true)) if self.one_transaction => {
                    tracing::warn!("idempotency: the claim asked again after its answer was lost found the key still held");
                    return Ok(Problem::ClaimHeld { retry_after }.response());
                }
                Ok((Outcome::InProgress { retry_after }, _, _)) => return Ok(Problem::InProgress { retry_after }.response()),
                Ok((Outcome::Mismatch { .. }, _, _)) => return Ok(Problem::Mismatch.response()),
                Err(Error::InvalidArgument(_)) => {
                    return Ok(Problem::KeyInvalid("The Idempotency-Key is not one the store accepts.").response());
                }
                Err(err) if lost.is_some() => {
                    tracing::error!(
                        "idempotency: the claim that would tell what became of key {} failed: {}",
                        key_hash(&key),
                        err.redacted()
                    );
                    return Ok(lost_answer(lost));
                }
                Err(err) if self.fail_open && err.is_connection() => {
                    tracing::warn!("idempotency: the database failed, running unguarded without it: {}", err.redacted());
                    return pass_through(inner, request.request()).await;
                }
                Err(err) if self.fail_open => {
                    tracing::warn!("idempotency: the claim failed, running unguarded: {}", err.redacted());
                    return self.run_answered(inner, &request).await;
                }
                Err(err) => {
                    tracing::error!("idempotency: the claim failed: {}", err.redacted());
                    return Ok(Problem::Unavailable.response());
                }
            };
            let claimed = Claimed { owner, fingerprint: &request_fingerprint, options: &options };
            match self.run(inner.clone(), &request, Some(&claimed), transaction).await {
                Run::Answered(answer) => return answer,
                // Claiming again with the token tells what became of this run.
                Run::Lost(answer) => lost = Some(answer),
            }
        }
        Ok(lost_answer(lost))
    }

    /// Runs the handler once, for an answer whatever happens.
    async fn run_answered<S, ReqBody, ResBody>(&self, inner: S, request: &Buffered) -> Result<Answer<ResBody>, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        match self.run(inner, request, None, None).await {
            Run::Answered(answer) => answer,
            // Without a claim there is no token to ask with.
            Run::Lost(None) => Ok(Problem::RolledBack.response()),
            Run::Lost(Some(_)) => Ok(Problem::Interrupted.response()),
        }
    }

    /// Runs the handler with a transaction of its own (`begun` with the
    /// claim in it, or begun when the handler first locks its `Tx`), then
    /// commits (with the stored response, for an owner) or rolls back.
    async fn run<S, ReqBody, ResBody>(&self, inner: S, request: &Buffered, claimed: Option<&Claimed<'_>>, begun: Option<Transaction<'static, Postgres>>) -> Run<ResBody, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let owner = claimed.map(|claimed| &claimed.owner);
        // Dropped before the end (a timeout outside the layer, a panic): the
        // transaction rolls back as it drops, and this frees the key.
        // With the claim in the transaction, its rollback frees the key.
        let claimed_apart = owner.filter(|_| !self.one_transaction);
        let mut free_on_drop = FreeOnDrop { pool: self.pool.clone(), owner: claimed_apart.cloned() };
        let loan = Loan::new(self.pool.clone(), begun);
        let mut handed = request.request();
        handed.extensions_mut().insert(loan.tx());
        if let Some(owner) = owner {
            handed.extensions_mut().insert(owner.clone());
        }
        let (answered, finished) = call_handler(inner, handed, &loan).await;
        let transaction = loan.end().await;
        free_on_drop.owner = None;
        match answered {
            Err(err) => {
                self.abandon(transaction, claimed, None).await;
                Run::Answered(Err(err))
            }
            Ok((_, Err(err))) => {
                tracing::error!("idempotency: the handler's response body failed: {err}");
                self.abandon(transaction, claimed, None).await;
                Run::Answered(Ok(Problem::ResponseUnreadable.response()))
            }
            Ok((head, Ok(body))) if !finished || head.status == StatusCode::REQUEST_TIMEOUT => {
                tracing::warn!(
                    "idempotency: the handler did not finish (status {} from a layer that answered for it): \
                     its work is rolled back and its key freed",
                    head.status
                );
                self.abandon(transaction, claimed, None).await;
                if head.status.is_client_error() || head.status.is_server_error() {
                    Run::Answered(Ok(Response::from_parts(head, full(body))))
                } else {
                    // A Tx kept past the handler's end (in a spawned task): not the handler's last word.
                    Run::Answered(Ok(Problem::RolledBack.response()))
                }
            }
            Ok((head, Ok(body))) => self.finish(transaction, claimed, head, body).await,
        }
    }

    /// Stores the handler's response and commits its work; rolls back a 5xx.
    async fn finish<B, E>(&self, transaction: Option<Transaction<'static, Postgres>>, claimed: Option<&Claimed<'_>>, head: response::Parts, body: Bytes) -> Run<B, E> {
        if head.status.is_server_error() {
            self.abandon(transaction, claimed, Some((&head, &body))).await;
            return Run::Answered(Ok(Response::from_parts(head, full(body))));
        }
        match (transaction, claimed) {
            (Some(transaction), claimed) => self.commit(transaction, claimed, head, body).await,
            (None, Some(claimed)) => self.complete_alone(&claimed.owner, head, body).await,
            (None, None) => Run::Answered(Ok(Response::from_parts(head, full(body)))),
        }
    }

    /// The key a source read, or the problem: none when one is required, or malformed.
    fn required(&self, key: Result<Option<String>, &'static str>) -> Result<Option<String>, Problem> {
        match key {
            Ok(None) if self.key_required => Err(Problem::KeyMissing),
            Ok(key) => Ok(key),
            Err(why) => Err(Problem::KeyInvalid(why)),
        }
    }

    /// Where this layer's claims go.
    fn flow(&self) -> Flow<'_> {
        Flow { pool: &self.pool, one_transaction: self.one_transaction, prepare: self.prepare }
    }

    /// Commits the handler's work with its stored response.
    async fn commit<B, E>(&self, transaction: Transaction<'static, Postgres>, claimed: Option<&Claimed<'_>>, head: response::Parts, body: Bytes) -> Run<B, E> {
        let Some(stored) = self.to_store(&head, &body) else {
            self.abandon(Some(transaction), claimed, None).await;
            return Run::Answered(Ok(Problem::RedactFailed.response()));
        };
        let owner = claimed.map(|claimed| &claimed.owner);
        let ended = self.flow().complete_and_commit(transaction, owner, stored.status_code, &pairs(&stored), &stored.body).await;
        match ended {
            Ended::Committed => Run::Answered(Ok(Response::from_parts(head, full(body)))),
            // A retry took the key over: its answer is the one that counts.
            Ended::ClaimLost => Run::Answered(Ok(Problem::ClaimLost.response())),
            Ended::LostBeforeCommit => Run::Lost(None),
            Ended::LostAtCommit => Run::Lost(Some((head, body))),
            Ended::NotStored(_) => {
                self.abandon(None, claimed, None).await;
                Run::Answered(Ok(Problem::RolledBack.response()))
            }
            Ended::Refused(_) => {
                if let Some(claimed) = claimed.filter(|_| !self.one_transaction) {
                    self.flow().release(&claimed.owner).await;
                }
                Run::Answered(Ok(Problem::RolledBack.response()))
            }
        }
    }

    /// Stores the response of a handler that wrote nothing, with `complete`
    /// in a transaction of its own: its statement is bound (unnamed, parsed
    /// and executed in two exchanges), which a transaction pooler keeps on
    /// one server connection only inside a transaction.
    async fn complete_alone<B, E>(&self, owner: &Owner, head: response::Parts, body: Bytes) -> Run<B, E> {
        let Some(response) = self.to_store(&head, &body) else {
            self.flow().release(owner).await;
            return Run::Answered(Ok(Problem::RedactFailed.response()));
        };
        let stored = async {
            let mut transaction = self.pool.begin().await?;
            let done = owner.complete_as(&mut *transaction, response.status_code, &pairs(&response), &response.body, self.prepare).await?;
            transaction.commit().await?;
            Ok::<_, Error>(done)
        };
        match stored.await {
            Ok(_) => Run::Answered(Ok(Response::from_parts(head, full(body)))),
            Err(Error::ClaimLost(_)) => Run::Answered(Ok(Problem::ClaimLost.response())),
            Err(err) if answer_lost(&err) => {
                tracing::warn!("idempotency: the answer to complete was lost: {}", err.redacted());
                Run::Lost(Some((head, body)))
            }
            Err(err) => {
                tracing::error!("idempotency: could not store the response: {}", err.redacted());
                self.flow().release(owner).await;
                Run::Answered(Ok(Problem::RolledBack.response()))
            }
        }
    }

    /// Rolls the transaction back and frees the key, so that a retry runs
    /// again. A 5xx response goes to `complete`, which releases it (or
    /// stores it, with `idempotency.store_server_errors` on). With
    /// `one_transaction` the rollback undid the claim: a 5xx is claimed
    /// again (with the request's token) for `complete`.
    async fn abandon(&self, transaction: Option<Transaction<'static, Postgres>>, claimed: Option<&Claimed<'_>>, server_error: Option<(&response::Parts, &Bytes)>) {
        if let Some(transaction) = transaction {
            let _ = transaction.rollback().await; // a broken connection rolls back too
        }
        let Some(claimed) = claimed else { return };
        let owner = match (self.one_transaction, server_error) {
            (false, _) => claimed.owner.clone(),
            (true, None) => return,
            (true, Some(_)) => match self.flow().claim_alone(&claimed.owner.key, claimed.fingerprint, claimed.options).await {
                Ok(Outcome::New(owner)) => owner,
                _ => return, // nothing of this request is held
            },
        };
        if let Some(stored) = server_error.and_then(|(head, body)| self.to_store(head, body)) {
            match owner.complete_as(&self.pool, stored.status_code, &pairs(&stored), &stored.body, self.prepare).await {
                Ok(_) | Err(Error::ClaimLost(_)) => return,
                Err(_) => {} // too large to store, say: release it
            }
        }
        self.flow().release(&owner).await;
    }

    /// What is stored of a response: its status, the headers to store and
    /// its body, as the redact hook leaves them; none when the hook
    /// panicked (nothing is stored, the key is freed).
    fn to_store(&self, head: &response::Parts, body: &Bytes) -> Option<StoredResponse> {
        let mut headers = Vec::new();
        // The body is stored as sent: its Content-Encoding (a compression layer inside) goes with it.
        let encoding = Some(&CONTENT_ENCODING).filter(|name| !self.stored_headers.contains(name));
        for name in self.stored_headers.iter().chain(encoding) {
            for value in head.headers.get_all(name) {
                if let Ok(value) = value.to_str() {
                    headers.push((name.as_str().to_owned(), value.to_owned()));
                }
            }
        }
        let stored = StoredResponse { status_code: head.status.as_u16(), headers, body: body.to_vec() };
        let Some(redact) = &self.redact else { return Some(stored) };
        let redacted = std::panic::catch_unwind(AssertUnwindSafe(|| redact(stored)));
        if redacted.is_err() {
            tracing::error!("idempotency: the redact hook panicked: nothing is stored, the key is freed");
        }
        redacted.ok()
    }
}

/// The headers of a stored response as `complete` takes them.
fn pairs(stored: &StoredResponse) -> Vec<(&str, &str)> {
    stored.headers.iter().map(|(name, value)| (name.as_str(), value.as_str())).collect()
}

/// The 503 after runs whose connection broke: whether the last may have committed.
fn lost_answer<B>(lost: Option<Option<(response::Parts, Bytes)>>) -> Answer<B> {
    match lost.flatten() {
        Some(_) => Problem::Interrupted.response(),
        None => Problem::RolledBack.response(),
    }
}

/// Calls the inner service and passes its response through.
async fn pass_through<S, ReqBody, ResBody>(mut inner: S, request: Request<ReqBody>) -> Result<Answer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    Ok(inner.call(request).await?.map(IdempotencyBody::streamed))
}

/// What the inner service answered, with its body read whole.
type Handled<E> = Result<(response::Parts, Result<Bytes, BoxError>), E>;

/// Calls the inner service with the request and reads its whole response
/// (a streaming body may still use the transaction). Also says whether the
/// handler finished: judged before the inner future is dropped, because a
/// layer that answers for the handler (tower-http's `TimeoutLayer`, its
/// `CatchPanicLayer` after a panic) leaves the handler's `Tx` alive in it,
/// or dropped by the panic.
async fn call_handler<S, B, ResBody>(mut inner: S, request: Request<B>, loan: &Loan) -> (Handled<S::Error>, bool)
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    if let Err(err) = poll_fn(|cx| inner.poll_ready(cx)).await {
        return (Err(err), true);
    }
    let mut future = pin!(inner.call(request));
    let handled = match future.as_mut().await {
        Ok(response) => {
            let (head, body) = response.into_parts();
            Ok((head, body.collect().await.map(|body| body.to_bytes()).map_err(Into::into)))
        }
        Err(err) => Err(err),
    };
    (handled, loan.handler_finished())
}

/// Reads the whole request body, up to `limit` bytes.
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(body) => Ok(body.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(Problem::RequestTooLarge),
        Err(_) => Err(Problem::RequestUnreadable),
    }
}
