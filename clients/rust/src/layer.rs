//! The tower `Layer`: Idempotency-Key on every POST and PATCH (by default),
//! as docs/http-contract.md says.
//!
//! For a covered request it reads the key and the body, claims the key on a
//! pooled connection (that claim commits at once, so a concurrent retry sees
//! it), then opens a transaction on the same connection and lends it to the
//! handler as a [`Tx`] in the request's extensions. When the handler has
//! answered, it buffers the response and, in that transaction, stores it
//! with `complete` and commits: the business writes and the stored response
//! commit together, or not at all.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::HttpBody;
use hyper::header::{HeaderName, CONTENT_TYPE, LOCATION};
use hyper::http::request::Parts;
use hyper::http::response;
use hyper::{Method, Request, Response};
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use crate::body::ResponseBody;
use crate::problem::{replay, Problem};
use crate::{claim, fingerprint, key, ClaimOptions, Error, Outcome, Owner, Pool, PooledClient, Tx};

/// Computes the scope of a request from its head.
type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;

/// What the layer's service answers.
type Answer<B> = Response<ResponseBody<B>>;

/// The layer: give it a [`Pool`] on the database of the business data, set
/// options with its builder methods, and wrap a service (an axum `Router`,
/// a hyper `service_fn`...) with it.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pool: Pool,
    methods: Vec<Method>,
    key_required: bool,
    fail_open: bool,
    lease: Option<Duration>,
    retention: Option<Duration>,
    stored_headers: Vec<HeaderName>,
    max_body_bytes: usize,
    scope: Arc<ScopeFn>,
}

impl IdempotencyLayer {
    /// A layer with the defaults: POST and PATCH, key required, fail closed,
    /// the database's lease and retention, Content-Type and Location stored,
    /// bodies up to 1 MiB, scope from the credential ([`credential_scope`]).
    pub fn new(pool: Pool) -> IdempotencyLayer {
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

    /// Panics when the retention is shorter than the lease.
    fn check_retention(&self) {
        if let (Some(lease), Some(retention)) = (self.lease, self.retention) {
            assert!(retention >= lease, "the idempotency retention must be at least the lease");
        }
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqBody: HttpBody + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: std::fmt::Display + Send,
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
            Box::pin(pass_through(inner, request))
        }
    }
}

impl IdempotencyLayer {
    /// Claims the request's key and answers: the handler's response, a
    /// replay, or a problem.
    async fn guard<S, ReqBody, ResBody>(&self, inner: S, request: Request<ReqBody>) -> Result<Answer<ResBody>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ReqBody: HttpBody + From<Bytes>,
        ResBody: HttpBody<Data = Bytes>,
        ResBody::Error: std::fmt::Display,
    {
        let key = match key::request_key(request.headers()) {
            Ok(None) if self.key_required => return Ok(Problem::KeyMissing.response()),
            Ok(key) => key,
            Err(why) => return Ok(Problem::KeyInvalid(why).response()),
        };
        let (parts, body) = request.into_parts();
        let body = match read_body(body, self.max_body_bytes).await {
            Ok(body) => body,
            Err(problem) => return Ok(problem.response()),
        };
        let claim_options = ClaimOptions {
            scope: Some((self.scope)(&parts)),
            lease: self.lease,
            retention: self.retention,
            wait: None,
        };
        let query = parts.uri.query().filter(|query| !query.is_empty());
        let request_fingerprint =
            fingerprint(parts.method.as_str(), parts.uri.path(), Some(&body[..]).filter(|b| !b.is_empty()), query);
        let request = Request::from_parts(parts, ReqBody::from(body));

        let mut conn = match self.pool.get().await {
            Ok(conn) => conn,
            Err(err) => return self.unguarded(inner, request, err).await,
        };
        let owner = match key {
            None => None,
            Some(key) => match claim(&*conn, &key, &request_fingerprint, &claim_options).await {
                Ok(Outcome::New(owner)) => Some(owner),
                Ok(Outcome::Replay { response, .. }) => return Ok(replay(response)),
                Ok(Outcome::InProgress { retry_after }) => return Ok(Problem::InProgress { retry_after }.response()),
                Ok(Outcome::Mismatch { .. }) => return Ok(Problem::Mismatch.response()),
                Err(Error::InvalidArgument(_)) => {
                    return Ok(Problem::KeyInvalid("The Idempotency-Key is not one the store accepts.").response())
                }
                Err(err) if self.fail_open => {
                    log::warn!("idempotency: the claim failed, running unguarded: {}", err);
                    None
                }
                Err(err) => {
                    log::error!("idempotency: the claim failed: {}", err);
                    return Ok(Problem::Unavailable.response());
                }
            },
        };
        if let Err(err) = conn.begin().await {
            self.abandon(conn, owner.as_ref(), None).await;
            return self.unguarded(inner, request, err).await;
        }
        self.run_in_transaction(inner, request, conn, owner).await
    }

    /// Runs the handler with the transaction, then commits or rolls back.
    async fn run_in_transaction<S, ReqBody, ResBody>(
        &self,
        mut inner: S,
        mut request: Request<ReqBody>,
        conn: PooledClient,
        owner: Option<Owner>,
    ) -> Result<Answer<ResBody>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ResBody: HttpBody<Data = Bytes>,
        ResBody::Error: std::fmt::Display,
    {
        let tx = Tx::new(conn);
        request.extensions_mut().insert(tx.clone());
        if let Some(owner) = &owner {
            request.extensions_mut().insert(owner.clone());
        }
        let answered = inner.call(request).await;
        // The body may still use the transaction: read it before taking the connection back.
        let response = match answered {
            Ok(response) => {
                let (head, body) = response.into_parts();
                Ok((head, hyper::body::to_bytes(body).await))
            }
            Err(err) => Err(err),
        };
        let conn = tx.take().await.expect("only the layer takes the connection");
        match response {
            Err(err) => {
                self.abandon(conn, owner.as_ref(), None).await;
                Err(err)
            }
            Ok((_, Err(err))) => {
                log::error!("idempotency: the handler's response body failed: {}", err);
                self.abandon(conn, owner.as_ref(), None).await;
                Ok(Problem::ResponseUnreadable.response())
            }
            Ok((head, Ok(body))) => Ok(self.finish(conn, owner.as_ref(), head, body).await),
        }
    }

    /// Commits the handler's work with its stored response; rolls back a 5xx.
    async fn finish<B>(&self, mut conn: PooledClient, owner: Option<&Owner>, head: response::Parts, body: Bytes) -> Answer<B> {
        if head.status.is_server_error() {
            self.abandon(conn, owner, Some((&head, &body))).await;
            return Response::from_parts(head, ResponseBody::full(body));
        }
        let committed = match owner {
            Some(owner) => match owner.complete(&*conn, head.status.as_u16(), &self.headers_to_store(&head), &body).await {
                Ok(_) => conn.end("COMMIT").await,
                Err(err) => Err(err),
            },
            None => conn.end("COMMIT").await,
        };
        match committed {
            Ok(()) => Response::from_parts(head, ResponseBody::full(body)),
            Err(Error::ClaimLost(_)) => {
                // A retry took the key over: its answer is the one that counts.
                let _ = conn.end("ROLLBACK").await;
                Problem::ClaimLost.response()
            }
            Err(err) => {
                log::error!("idempotency: could not store the response: {}", err);
                self.abandon(conn, owner, None).await;
                Problem::Unavailable.response()
            }
        }
    }

    /// Rolls the transaction back and frees the key, so that a retry runs
    /// again. A 5xx response goes to `complete`, which releases it (or
    /// stores it, with `idempotency.store_server_errors` on).
    async fn abandon(&self, mut conn: PooledClient, owner: Option<&Owner>, server_error: Option<(&response::Parts, &Bytes)>) {
        if conn.end("ROLLBACK").await.is_err() {
            return; // the connection is gone, and the transaction with it
        }
        let owner = match owner {
            Some(owner) => owner,
            None => return,
        };
        if let Some((head, body)) = server_error {
            let status = head.status.as_u16();
            if owner.complete(&*conn, status, &self.headers_to_store(head), body).await.is_ok() {
                return;
            }
        }
        if let Err(err) = owner.release(&*conn).await {
            log::error!("idempotency: could not release key {:?}; it frees when its lease ends: {}", owner.key, err);
        }
    }

    /// Answers 503, or with `fail_open` runs the handler without the database.
    async fn unguarded<S, ReqBody, ResBody>(&self, inner: S, request: Request<ReqBody>, err: Error) -> Result<Answer<ResBody>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        if self.fail_open {
            log::warn!("idempotency: the database failed, running unguarded: {}", err);
            pass_through(inner, request).await
        } else {
            log::error!("idempotency: the database failed: {}", err);
            Ok(Problem::Unavailable.response())
        }
    }

    /// The response headers to store, as name-value pairs.
    fn headers_to_store<'a>(&'a self, head: &'a response::Parts) -> Vec<(&'a str, &'a str)> {
        let mut pairs = Vec::new();
        for name in self.stored_headers.iter() {
            for value in head.headers.get_all(name) {
                if let Ok(value) = value.to_str() {
                    pairs.push((name.as_str(), value));
                }
            }
        }
        pairs
    }
}

/// Calls the inner service and passes its response through.
async fn pass_through<S, ReqBody, ResBody>(mut inner: S, request: Request<ReqBody>) -> Result<Answer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    Ok(inner.call(request).await?.map(ResponseBody::passed))
}

/// Reads the whole request body, up to `limit` bytes.
async fn read_body<B: HttpBody>(body: B, limit: usize) -> Result<Bytes, Problem> {
    let mut body = Box::pin(body);
    let mut bytes = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|_| Problem::RequestUnreadable)?;
        if bytes.len() + hyper::body::Buf::remaining(&chunk) > limit {
            return Err(Problem::RequestTooLarge);
        }
        bytes.put(chunk);
    }
    Ok(bytes.freeze())
}
