"""OpenTelemetry spans of the calls that decide a request's fate:
``idempotency.claim``, ``idempotency.complete`` and ``idempotency.release``,
kind INTERNAL, with the outcome, the attempt and a hash of the key (never
the key, the scope, a body or a header value).

Through ``opentelemetry-api`` when it is installed (the ``opentelemetry``
extra): without an SDK its tracer is the no-op one; without the API these
are plain context managers that do nothing.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Iterator, Optional

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:   # the app does not trace
    trace = None

try:
    from importlib.metadata import PackageNotFoundError, version
    VERSION: Optional[str] = version("pg-idempotency")
except (ImportError, PackageNotFoundError):
    VERSION = None


def key_hash(key: str) -> str:
    """The key as spans show it: the first 16 hex digits of SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class _NoSpan:
    """What a span is when nothing records one."""

    def is_recording(self) -> bool:
        """Never."""
        return False

    def set_attribute(self, name: str, value: Any) -> None:
        """Keeps nothing."""


NO_SPAN = _NoSpan()


class Telemetry:
    """Makes the spans, on the app's tracer provider or the global one."""

    def __init__(self, tracer_provider=None):
        """tracer_provider: an OpenTelemetry TracerProvider; None: the global one."""
        self.tracer = None
        if trace is not None:
            self.tracer = trace.get_tracer("pg_idempotency", VERSION, tracer_provider=tracer_provider)

    @contextmanager
    def span(self, name: str, key: Optional[str]) -> Iterator[Any]:
        """A span idempotency.<name> around a call on key: an error sets its
        status to error with the SQLSTATE as db.response.status_code (the
        exception's message is not recorded: it may quote the key)."""
        if self.tracer is None:
            yield NO_SPAN
            return
        with self.tracer.start_as_current_span(
                "idempotency." + name, kind=SpanKind.INTERNAL,
                record_exception=False, set_status_on_exception=False) as span:
            if key is not None and span.is_recording():
                span.set_attribute("idempotency.key_hash", key_hash(key))
            try:
                yield span
            except BaseException as err:
                _failed(span, err)
                raise


def outcome(span, answer: str, attempt: Optional[int] = None) -> None:
    """Records what the call answered (and the claim's attempt, when it gives one)."""
    if span.is_recording():
        span.set_attribute("idempotency.outcome", answer)
        if attempt is not None:
            span.set_attribute("idempotency.attempt", attempt)


def release_outcome(released: bool) -> str:
    """The outcome of release(): released, or not_owned when the fence no longer owned the key."""
    return "released" if released else "not_owned"


def _failed(span, err: BaseException) -> None:
    """Marks span as failed by err: its SQLSTATE, or its kind when it has none."""
    if not span.is_recording():
        return
    cause = err.__cause__ if getattr(err, "sqlstate", None) is None else err
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate:
        span.set_attribute("db.response.status_code", sqlstate)
    span.set_attribute("error.type", sqlstate or type(err).__qualname__)
    span.set_status(Status(StatusCode.ERROR, sqlstate))
