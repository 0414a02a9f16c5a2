"""The HTTP contract (docs/http-contract.md), shared by the middlewares
(Flask, ASGI, Django): the Idempotency-Key field or a webhook key source,
the scope, the request's fingerprint, what is stored of a response (the
redact option), the answers (problem+json, replays) and the options.

Nothing here does I/O or knows a framework: headers come in as pairs of
(lowercase name, raw bytes), answers go out as an Answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import string
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union
from urllib.parse import quote
from uuid import UUID

import psycopg

from .client import Claim
from .fingerprint import fingerprint

log = logging.getLogger("pg_idempotency")

Headers = Sequence[Tuple[str, bytes]]
Interval = Union[str, timedelta, None]

MAX_KEY_BYTES = 255
# RFC 9110 tchar, plus ":" and "/": what a bare key may be made of.
BARE_KEY_CHARS = frozenset("!#$%&'*+-.^_`|~:/" + string.ascii_letters + string.digits)
# What a path may hold unescaped (RFC 3986 pchar and "/"), to rebuild a raw path.
PATH_CHARS = "/:@!$&'()*+,;=-._~"
TITLES = {400: "Bad Request", 401: "Unauthorized", 409: "Conflict", 413: "Content Too Large",
          422: "Unprocessable Content", 500: "Internal Server Error", 503: "Service Unavailable"}
PROBLEMS = {
    "idempotency_key_missing": (400, "This request needs an Idempotency-Key header."),
    "idempotency_key_invalid": (400, "The Idempotency-Key header is not a valid key."),
    "idempotency_key_in_progress": (409, "A request with this Idempotency-Key is still running; retry later."),
    "idempotency_key_mismatch": (422, "This Idempotency-Key was used with a different request."),
    "idempotency_claim_lost": (409, "This request outlived its lease and a retry took it over; retry it."),
    "request_body_too_large": (413, "The request body is larger than this server reads."),
    "idempotency_unavailable": (503, "The idempotency store cannot be reached; retry later."),
    "webhook_unverified": (401, "The webhook did not verify."),
    "webhook_rejected": (400, "The webhook's event cannot be processed."),
    "webhook_handler_failed": (500, "The webhook's handler failed; deliver it again."),
    "idempotency_redact_failed": (500, "The response could not be redacted for storing; nothing was kept."),
}


class Answer(NamedTuple):
    """A response the middleware gives instead of the handler's."""
    status: int
    headers: List[Tuple[str, str]]
    body: bytes


class Stored(NamedTuple):
    """A response as complete() stores it: what the redact option gets and returns."""
    status: int
    headers: dict
    body: bytes


class RedactFailed(Exception):
    """The redact option raised (the cause): nothing is stored, the key is released."""


class Unverified(Exception):
    """A webhook delivery that did not verify (401), refused before any claim: the message says why."""


class Pending(NamedTuple):
    """A covered request whose handler runs: its claim (fence None:
    unguarded), what claims it again: the token and the fingerprint, and
    what its last complete() stored, to know its own replay after a lost COMMIT."""
    key: Optional[str] = None
    scope: str = ""
    fence: Optional[int] = None
    token: Optional[UUID] = None
    fingerprint: Optional[bytes] = None
    stored: Optional[Stored] = None


# The pauses before each claim of a request asked again because the
# answer was lost: 3 more claims, each on a fresh connection, then 503.
CLAIM_BACKOFF = (0.05, 0.1, 0.2)
# How many times a handler whose COMMIT was lost and rolled back runs again.
RERUNS = 3


class InvalidKey(ValueError):
    """The Idempotency-Key field is malformed; the message says how."""


@dataclass
class Options:
    """The middleware's options (see README.md); every middleware takes them as keywords."""
    methods: Iterable[str] = ("POST", "PATCH")
    required: bool = True
    fail_open: bool = False
    lease: Interval = None
    retention: Interval = None
    store_headers: Iterable[str] = ("Content-Type", "Location")
    scope: Optional[Callable[[Any], str]] = None
    exempt: Optional[Callable[[Any], bool]] = None
    tracer_provider: Any = None
    one_transaction: bool = False
    wait: Interval = None
    redact: Optional[Callable[[Stored], Stored]] = None
    source: Any = None   # a webhook source (pg_idempotency.webhooks): where the key and the scope come from
    prepare: bool = False   # Flask, ASGI: the extension's calls as prepared statements (Client's prepare)

    def __post_init__(self):
        """Normalises the case of methods and header names; one transaction
        needs a positive wait (2 seconds unless given)."""
        self.methods = frozenset(m.upper() for m in self.methods)
        self.store_headers = frozenset(h.lower() for h in self.store_headers)
        if self.one_transaction:
            if self.wait is None:
                self.wait = ONE_TRANSACTION_WAIT
            if not _positive(self.wait):
                raise ValueError("one_transaction needs a positive wait: a duplicate would "
                                 "otherwise wait for the first without a bound")


# How long, with one transaction, a duplicate waits for the request it
# repeats to commit or roll back before it answers 409.
ONE_TRANSACTION_WAIT = "2 seconds"


def _positive(interval: Interval) -> bool:
    """True for a timedelta above zero, or an interval's text with a digit
    other than 0 and nothing that negates it (a minus sign, "ago"): the
    extension would refuse a negative wait at every claim."""
    if isinstance(interval, timedelta):
        return interval > timedelta(0)
    text = str(interval)
    return any(c in "123456789" for c in text) and "-" not in text and "ago" not in text.lower()


def parse_key(values: Sequence[str]) -> Optional[str]:
    """Returns the key sent in the Idempotency-Key field values, None when
    there is none; raises InvalidKey when it is malformed."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKey("The Idempotency-Key header was sent more than once.")
    text = values[0].strip(" \t")
    key = _parse_sf_string(text) if text.startswith('"') else _parse_bare(text)
    if not key:
        raise InvalidKey("The Idempotency-Key is empty.")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKey(f"The Idempotency-Key is longer than {MAX_KEY_BYTES} bytes.")
    return key


def _parse_sf_string(text: str) -> str:
    """Returns the content of a Structured Field string that must fill text."""
    chars, i = [], 1
    while i < len(text):
        c = text[i]
        if c == '"':
            if i != len(text) - 1:
                raise InvalidKey("The Idempotency-Key string is followed by something else.")
            return "".join(chars)
        if c == "\\":
            if text[i + 1:i + 2] not in ('"', "\\"):
                raise InvalidKey("The Idempotency-Key string has an escape other than \\\" or \\\\.")
            i += 1
            c = text[i]
        elif not " " <= c <= "~":
            raise InvalidKey("The Idempotency-Key string has a character that is not printable ASCII.")
        chars.append(c)
        i += 1
    raise InvalidKey("The Idempotency-Key string has no closing double quote.")


def _parse_bare(text: str) -> str:
    """Returns a key sent without quotes: token characters, not starting with ':'."""
    if text.startswith(":") or not set(text) <= BARE_KEY_CHARS:
        raise InvalidKey('The Idempotency-Key must be a quoted string ("...") or a token.')
    return text


def key_values(headers: Headers) -> List[str]:
    """Returns the values of the Idempotency-Key fields, as sent."""
    return [value.decode("latin-1") for name, value in headers if name == "idempotency-key"]


def covers(options: Options, method: str, request: Any) -> bool:
    """True when the middleware guards the request: a method of options.methods,
    and not one the exempt option (a function of the framework's request) exempts."""
    return method in options.methods and not (options.exempt and options.exempt(request))


def read_key(headers: Headers, options: Options) -> Tuple[Optional[str], Optional[Answer]]:
    """Returns (key, None), (None, None) for a missing optional key, or (None, the 400 answer)."""
    try:
        key = parse_key(key_values(headers))
    except InvalidKey as bad:
        return None, problem("idempotency_key_invalid", str(bad))
    if key is None and options.required:
        return None, problem("idempotency_key_missing")
    return key, None


def identify(options: Options, request: Any, headers: Headers,
             body: bytes) -> Tuple[Optional[str], str, Optional[Answer]]:
    """Returns the request's (key, scope, None): from the Idempotency-Key
    field and the scope option, or, with a source option (a webhook source
    of pg_idempotency.webhooks), the delivery's verified event id and its
    sender's scope; (None, '', None) for a missing optional key; (None, '',
    the refusal) for a malformed key (400) or a delivery that did not verify
    (401), which is never claimed."""
    if options.source is not None:
        try:
            event = options.source.event([(name, value.decode("latin-1")) for name, value in headers], body)
        except Unverified as err:
            return None, "", problem("webhook_unverified", str(err))
        return event.key, event.scope, None
    key, refusal = read_key(headers, options)
    if key is None:
        return None, "", refusal
    return key, claim_scope(options, request, headers), None


def credential_scope(headers: Headers) -> str:
    """Returns the hex SHA-256 of the caller's credential (Authorization,
    else X-API-Key), '' without one: the credential itself is never stored."""
    for wanted in ("authorization", "x-api-key"):
        for name, value in headers:
            if name == wanted:
                return hashlib.sha256(wanted.encode() + b":" + value).hexdigest()
    return ""


def claim_scope(options: Options, request: Any, headers: Headers) -> str:
    """Returns the scope of a request's key: what the scope option says (the
    authenticated principal), or, when it is unset or says None, the hash of
    the caller's credential."""
    scope = options.scope(request) if options.scope else None
    return credential_scope(headers) if scope is None else scope


def request_fingerprint(method: str, path: bytes, query: Optional[bytes],
                        body: Optional[bytes]) -> bytes:
    """Returns the fingerprint of a request: an empty body or query counts as none."""
    return fingerprint(method, path, body or None, query or None)


def wsgi_fingerprint(environ: dict, method: str, body: Optional[bytes]) -> bytes:
    """Returns the fingerprint of a WSGI request as sent: the raw target
    when the server gives it (gunicorn's RAW_URI, REQUEST_URI), else the
    path re-escaped, and the raw body."""
    target = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if target:
        path, query = split_target(target.encode("latin-1"))
    else:
        path = quote((environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")).encode("latin-1"),
                     safe=PATH_CHARS).encode()
        query = environ.get("QUERY_STRING", "").encode("latin-1")
    return request_fingerprint(method, path, query, body)


def split_target(target: bytes) -> Tuple[bytes, Optional[bytes]]:
    """Splits a raw request target into its path and its query (None without '?')."""
    if not target.startswith(b"/") and b"://" in target:
        # Absolute form (a request sent to a proxy): drop scheme and authority.
        rest = target.split(b"://", 1)[1]
        target = b"/" + rest.split(b"/", 1)[1] if b"/" in rest else b"/"
    path, mark, query = target.partition(b"?")
    return path, query if mark else None


def problem(code: str, detail: Optional[str] = None, retry_after: Optional[int] = None) -> Answer:
    """Returns the application/problem+json answer (RFC 9457) of a contract code."""
    status, default_detail = PROBLEMS[code]
    body = {"type": "about:blank", "title": TITLES[status], "status": status,
            "detail": detail or default_detail, "code": code}
    headers = [("Content-Type", "application/problem+json")]
    if retry_after is not None:
        headers.append(("Retry-After", str(max(1, retry_after))))
    return Answer(status, headers, json.dumps(body).encode())


def unavailable(err: BaseException) -> Answer:
    """Fails closed: without the store a retry could run twice (logged)."""
    log.error("idempotency: the store failed: %s", err)
    return problem("idempotency_unavailable", retry_after=1)


def answer_lost(err: BaseException) -> bool:
    """True when err says the database's answer never arrived (the
    connection broke, or none could be had), not that it refused."""
    if not isinstance(err, psycopg.OperationalError):
        return False
    return err.sqlstate is None or err.sqlstate.startswith(("08", "57P"))


def outcome_unknown(err: BaseException) -> Answer:
    """The 503 after a COMMIT whose answer was lost, when asking again failed
    too: the request may have run, and its retry replays it if it did."""
    log.error("idempotency: a COMMIT's answer was lost and the claim could not be asked again: %s", err)
    return problem("idempotency_unavailable",
                   "The idempotency store was lost before this request's outcome was known; "
                   "retry it: it is replayed if it completed.", retry_after=1)


def after_lost_commit(claim: Claim, answer: Answer, options: Options, stored: Optional[Stored] = None) -> Answer:
    """The answer when a claim asked again after a lost COMMIT is not new:
    replay, it committed (two transactions: the claim was ours, so this is
    the handler's answer; one: the handler's answer when the replay is of
    what it stored, else the stored response, a duplicate's); otherwise
    another request took the key (two transactions: 409 claim lost; one:
    its claim's answer, 409 in progress)."""
    if options.one_transaction:
        return answer if own_replay(claim, stored) else answer_claim(claim)
    return answer if claim.outcome == "replay" else claim_lost()


def own_replay(claim: Claim, stored: Optional[Stored]) -> bool:
    """True when claim replays what this request stored (stored: what its
    complete() stored before the COMMIT's answer was lost), not a
    duplicate's response."""
    return (stored is not None and claim.outcome == "replay" and claim.status_code == stored.status
            and bytes(claim.body or b"") == stored.body)


def with_stored(pending: Pending, answer: Answer, options: Options) -> Pending:
    """pending with what complete() is to store of answer (to_store; it
    raises RedactFailed); unguarded (no fence), pending as it is."""
    if pending.fence is None:
        return pending
    return pending._replace(stored=to_store(answer, options))


def redact_failed(pending: Pending, err: RedactFailed) -> Answer:
    """The 500 when the redact option failed: the work's writes roll back and
    its key is released, as for a handler that raised (logged)."""
    log.error("idempotency: the response of %r was not stored: %s", pending.key, err)
    return problem("idempotency_redact_failed")


def claim_lost() -> Answer:
    """The answer when complete() found that a retry took the claim over."""
    return problem("idempotency_claim_lost", retry_after=1)


def refused_key(err: psycopg.Error) -> Optional[Answer]:
    """The 400 answer when the extension refused the key, else None: another
    22023 (a bad scope or lease) is the application's fault, not the client's."""
    if err.sqlstate == "22023" and err.diag.message_primary == "invalid idempotency key":
        return problem("idempotency_key_invalid", "The extension refused this Idempotency-Key.")
    return None


# 408 Request Timeout: what a timeout layer inside the middleware answers
# after it cancelled the handler (a layer's answer looks like the handler's
# to the middleware otherwise). A handler that finished does not answer
# that the request timed out; if one does, its retry runs again.
UNFINISHED = frozenset({408})


def unfinished(status: int) -> bool:
    """True when a response says the handler did not finish: it never commits
    the handler's writes and is never stored; the key is released."""
    if status in UNFINISHED:
        log.warning("idempotency: a %d says the handler did not finish: "
                    "its writes roll back and its key is released", status)
        return True
    return False


def answer_claim(claim: Claim, asked_again: bool = False) -> Optional[Answer]:
    """Answers a claim that did not win (replay, in_progress, mismatch); None
    for new. asked_again: with one transaction, the claim was asked again
    after an answer was lost (see held_by_lost_attempt)."""
    if claim.outcome == "new":
        return None
    if claim.outcome == "replay":
        headers = list(_header_pairs(claim.headers or {}))
        headers.append(("Idempotent-Replayed", "true"))
        return Answer(claim.status_code, headers, bytes(claim.body or b""))
    if claim.outcome == "in_progress":
        if asked_again:
            return held_by_lost_attempt(claim)
        return problem("idempotency_key_in_progress", retry_after=claim.retry_after or 1)
    if claim.outcome == "mismatch":
        return problem("idempotency_key_mismatch")
    raise ValueError(f"unknown claim outcome {claim.outcome!r}")


def held_by_lost_attempt(claim: Claim) -> Answer:
    """With one transaction, a claim asked again after an answer was lost
    that found the key in progress: most likely held by the lost attempt's
    own transaction, which never commits and lasts until the server learns
    its connection is gone (a half-open connection). Not a 409 for the
    request's own claim: a 503, nothing of it was kept."""
    log.warning("idempotency: a claim asked again after a lost answer found the key still held")
    return problem("idempotency_unavailable",
                   "The connection to the idempotency store was lost while this request was claimed; "
                   "nothing of it was kept; retry later.", retry_after=claim.retry_after or 1)


def _header_pairs(stored: dict) -> Iterable[Tuple[str, str]]:
    """Yields the (name, value) pairs of headers stored as {name: value or [values]}."""
    for name, value in stored.items():
        for one in value if isinstance(value, list) else [value]:
            yield name, one


# Stored with the body whatever store_headers says: without it the stored
# bytes (compressed by a middleware inside this one) cannot be read.
BODY_HEADERS = frozenset({"content-encoding"})


def to_store(answer: Answer, options: Options) -> Stored:
    """Returns what complete() stores of a response: its status, the headers
    a replay repeats and its body, as the redact option changes them (the
    live response is left as it is). Raises RedactFailed when redact raises
    or returns something else than a Stored."""
    stored = Stored(answer.status, headers_to_store(answer.headers, options), bytes(answer.body))
    if options.redact is None:
        return stored
    try:
        redacted = options.redact(stored)
    except Exception as err:
        raise RedactFailed(f"the redact option raised: {err!r}") from err
    if not isinstance(redacted, Stored):
        raise RedactFailed(f"the redact option returned {type(redacted).__name__}, not a Stored")
    return redacted


def headers_to_store(headers: Iterable[Tuple[str, str]], options: Options) -> dict:
    """Picks the response headers a replay repeats, as {name: value or [values]},
    a name spelt as it first appears."""
    spelling: dict = {}
    values: dict = {}
    for name, value in headers:
        lower = name.lower()
        if lower in options.store_headers or lower in BODY_HEADERS:
            values.setdefault(spelling.setdefault(lower, name), []).append(value)
    return {name: found[0] if len(found) == 1 else found for name, found in values.items()}
