//! The layer's own answers: RFC 9457 problems (application/problem+json)
//! with a stable `code`, as docs/http-contract.md lists them, and replays.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use serde_json::json;

use crate::body::ResponseBody;
use crate::layer::full;
use crate::{Error, StoredResponse};

/// Why the layer answers instead of the handler.
#[derive(Debug)]
pub(crate) enum Problem {
    KeyMissing,
    KeyInvalid(&'static str),
    Unverified,
    InProgress { retry_after: u32 },
    Mismatch,
    ClaimLost,
    ClaimHeld { retry_after: u32 },
    Unavailable,
    RolledBack,
    Interrupted,
    RequestTooLarge,
    RequestUnreadable,
    ResponseUnreadable,
    RedactFailed,
    DatabaseFailed,
    Misused(&'static str),
}

impl From<&Error> for Problem {
    /// What a handler's `Error` answers.
    fn from(err: &Error) -> Problem {
        match err {
            Error::ClaimLost(_) => Problem::ClaimLost,
            Error::Database(_) => Problem::DatabaseFailed,
            Error::InvalidArgument(_) => Problem::Misused("The idempotency store refused an argument."),
            Error::TooLarge(_) => Problem::Misused("The response is larger than the idempotency store keeps."),
            Error::TransactionEnded => Problem::Misused("The request's transaction was used after the request ended."),
            Error::NotGuarded => Problem::Misused("This route needs a transaction but is not behind the idempotency layer."),
        }
    }
}

impl Problem {
    /// Status, title, code and detail of the problem.
    fn parts(&self) -> (StatusCode, &'static str, &'static str, &'static str) {
        match self {
            Problem::KeyMissing => (
                StatusCode::BAD_REQUEST,
                "Bad Request",
                "idempotency_key_missing",
                "This request needs an Idempotency-Key header.",
            ),
            Problem::KeyInvalid(why) => (StatusCode::BAD_REQUEST, "Bad Request", "idempotency_key_invalid", why),
            Problem::Unverified => (
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "webhook_unverified",
                "The request could not be verified (its signature or timestamp); nothing was claimed.",
            ),
            Problem::InProgress { .. } => (
                StatusCode::CONFLICT,
                "Conflict",
                "idempotency_key_in_progress",
                "A request with this Idempotency-Key is still in progress; retry after Retry-After seconds.",
            ),
            Problem::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "Unprocessable Content",
                "idempotency_key_mismatch",
                "This Idempotency-Key was used with a different request.",
            ),
            Problem::ClaimLost => (
                StatusCode::CONFLICT,
                "Conflict",
                "idempotency_claim_lost",
                "This request ran past its lease and a retry took it over; its work was rolled back.",
            ),
            Problem::ClaimHeld { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "idempotency_unavailable",
                "The connection to the idempotency store was lost while this request was claimed; \
                 nothing of it was kept; retry later.",
            ),
            Problem::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "idempotency_unavailable",
                "The idempotency store cannot be reached, so this request did not run; retry later.",
            ),
            Problem::RolledBack => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "idempotency_unavailable",
                "The response could not be stored, so this request's work was rolled back; retry later.",
            ),
            Problem::Interrupted => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "idempotency_unavailable",
                "The idempotency store stopped answering while this request ran, so it may have completed; \
                 retry with the same Idempotency-Key, which replays its response if it did.",
            ),
            Problem::RequestTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "Content Too Large",
                "request_body_too_large",
                "The request body is larger than this API accepts.",
            ),
            Problem::RequestUnreadable => (
                StatusCode::BAD_REQUEST,
                "Bad Request",
                "request_body_unreadable",
                "The request body could not be read.",
            ),
            Problem::ResponseUnreadable => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal Server Error",
                "response_body_unreadable",
                "The handler's response body failed; its work was rolled back.",
            ),
            Problem::RedactFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal Server Error",
                "idempotency_redact_failed",
                "The response could not be redacted for storing; nothing of it was kept.",
            ),
            Problem::DatabaseFailed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "idempotency_unavailable",
                "The database failed while this request ran, so its work was not kept; retry later.",
            ),
            Problem::Misused(why) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error", "idempotency_error", why)
            }
        }
    }

    /// The Retry-After this problem asks for, if any.
    fn retry_after(&self) -> Option<u32> {
        match self {
            Problem::InProgress { retry_after } | Problem::ClaimHeld { retry_after } => Some(*retry_after),
            Problem::ClaimLost
            | Problem::Unavailable
            | Problem::RolledBack
            | Problem::Interrupted
            | Problem::DatabaseFailed => Some(1),
            _ => None,
        }
    }

    /// The problem as a response.
    pub(crate) fn response<B>(&self) -> Response<ResponseBody<B>> {
        let (status, title, code, detail) = self.parts();
        let body = json!({
            "type": "about:blank",
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
            "code": code,
        });
        let mut response = Response::new(full(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after() {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The stored response again, marked `Idempotent-Replayed: true`.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let mut response = Response::new(full(Bytes::from(stored.body)));
    *response.status_mut() = StatusCode::from_u16(stored.status_code).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name.as_str()), HeaderValue::try_from(value.as_str())) {
            headers.append(name, value);
        }
    }
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}
