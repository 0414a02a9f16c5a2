//! The bodies the layer passes on: a body streamed as it came, or a whole
//! buffer (a request read to hash it, a response stored or replayed, a
//! problem). The layer is generic over the bodies around it, as tower-http's
//! layers are: it takes any request body and hands the inner service a
//! [`RequestBody`] of it, and wraps the inner service's response body in a
//! [`ResponseBody`].

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

/// The error type bodies convert into.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    #[project = KindProjection]
    enum Kind<B> {
        Streamed { #[pin] body: B },
        Whole { #[pin] body: Full<Bytes> },
    }
}

pin_project! {
    /// A body the layer passes on: `B` streamed untouched (a request or
    /// response the layer does not guard), or a whole buffer. Empty by
    /// default, so that layers that need `Default` bodies (tower-http's
    /// `TimeoutLayer`) compose with it.
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

/// What the inner service gets as request body: the request's own body
/// streamed (methods the layer does not guard), or the bytes the layer read
/// (guarded requests: a handler run again gets them again).
pub type RequestBody<B> = IdempotencyBody<B>;

/// What the layer answers with: the handler's own body, streamed, when the
/// request passes through untouched; else a whole buffer (the handler's
/// buffered response, a replay or a problem).
pub type ResponseBody<B> = IdempotencyBody<B>;

impl<B> IdempotencyBody<B> {
    /// `body`, streamed as it comes.
    pub(crate) fn streamed(body: B) -> IdempotencyBody<B> {
        IdempotencyBody { kind: Kind::Streamed { body } }
    }

    /// A whole buffer.
    pub(crate) fn whole(bytes: Bytes) -> IdempotencyBody<B> {
        IdempotencyBody { kind: Kind::Whole { body: Full::new(bytes) } }
    }
}

impl<B> fmt::Debug for IdempotencyBody<B> {
    /// Which kind of body it is.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Streamed { .. } => "streamed",
            Kind::Whole { .. } => "whole",
        };
        f.debug_struct("IdempotencyBody").field("kind", &kind).finish()
    }
}

impl<B> Default for IdempotencyBody<B> {
    /// An empty body.
    fn default() -> IdempotencyBody<B> {
        IdempotencyBody::whole(Bytes::new())
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    /// The next frame of whichever body it is.
    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProjection::Streamed { body } => body.poll_frame(cx).map_err(Into::into),
            KindProjection::Whole { body } => body.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    /// Whether the body has ended.
    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Streamed { body } => body.is_end_stream(),
            Kind::Whole { body } => body.is_end_stream(),
        }
    }

    /// The size, exact for a whole buffer.
    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Streamed { body } => body.size_hint(),
            Kind::Whole { body } => body.size_hint(),
        }
    }
}
