//! The body of the layer's responses: the handler's own, streamed, when the
//! layer lets a request through untouched; else a buffer it holds whole.

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::{Bytes, HttpBody, SizeHint};
use hyper::HeaderMap;
use pin_project_lite::pin_project;

pin_project! {
    /// A response body of the [`crate::Idempotency`] service.
    #[derive(Debug)]
    #[project = ResponseBodyProj]
    pub enum ResponseBody<B> {
        /// The inner service's body, untouched.
        Passed { #[pin] inner: B },
        /// A whole body: a buffered, stored, replayed or problem one.
        Buffered { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    /// A body of these bytes.
    pub(crate) fn full(bytes: Bytes) -> ResponseBody<B> {
        ResponseBody::Buffered { data: if bytes.is_empty() { None } else { Some(bytes) } }
    }

    /// The inner service's body.
    pub(crate) fn passed(inner: B) -> ResponseBody<B> {
        ResponseBody::Passed { inner }
    }
}

impl<B: HttpBody<Data = Bytes>> HttpBody for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    /// The next chunk: the inner body's, or the whole buffer once.
    fn poll_data(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, B::Error>>> {
        match self.project() {
            ResponseBodyProj::Passed { inner } => inner.poll_data(cx),
            ResponseBodyProj::Buffered { data } => Poll::Ready(data.take().map(Ok)),
        }
    }

    /// The inner body's trailers; a buffer has none.
    fn poll_trailers(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Option<HeaderMap>, B::Error>> {
        match self.project() {
            ResponseBodyProj::Passed { inner } => inner.poll_trailers(cx),
            ResponseBodyProj::Buffered { .. } => Poll::Ready(Ok(None)),
        }
    }

    /// True when nothing is left to send.
    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Passed { inner } => inner.is_end_stream(),
            ResponseBody::Buffered { data } => data.is_none(),
        }
    }

    /// The exact length of a buffer (so that it goes out with Content-Length).
    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Passed { inner } => inner.size_hint(),
            ResponseBody::Buffered { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
