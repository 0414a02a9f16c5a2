"""Flask extension: Idempotency-Key on top of the idempotency extension.

For the methods it covers, it claims the key in its own transaction
(committed at once, so that a concurrent retry sees it), lets the view work
in a second transaction on ``g.db``, and when the view has answered, stores
the response with idempotency.complete() in that same transaction: the
business writes and the stored response commit together.
"""

import hashlib
import logging

import psycopg
from flask import Response, g, jsonify, request
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb

log = logging.getLogger(__name__)

CLAIM = """
    SELECT outcome, fence, status_code, headers, body, retry_after
      FROM idempotency.claim(%(key)s,
                             idempotency.fingerprint(%(method)s, %(path)s,
                                                     %(body)s, %(query)s),
                             scope => %(scope)s, lease => %(lease)s::interval,
                             retention => %(retention)s::interval)"""
COMPLETE = "SELECT idempotency.complete(%s, %s, %s, %s, %s::jsonb, %s)"
RELEASE = "SELECT idempotency.release(%s, %s, %s)"


class Idempotency:
    """Guards the app's POST and PATCH requests with Idempotency-Key."""

    def __init__(self, app=None, *, conninfo, methods=("POST", "PATCH"),
                 required=True, fail_open=False, lease="60 seconds",
                 retention=None, store_headers=("content-type", "location")):
        """Takes the options; see README.md. conninfo is libpq's (DATABASE_URL)."""
        self.conninfo = conninfo
        self.methods = {m.upper() for m in methods}
        self.required = required
        self.fail_open = fail_open
        self.lease = lease
        self.retention = retention
        self.store_headers = [h.lower() for h in store_headers]
        if app is not None:
            self.init_app(app)

    def init_app(self, app):
        """Registers the hooks around every request of app."""
        app.before_request(self._before)
        app.after_request(self._after)
        app.teardown_request(self._teardown)

    def _before(self):
        """Claims the key: answers here, or lets the view run on g.db."""
        if request.method not in self.methods:
            return None
        key = request.headers.get("Idempotency-Key")
        if key is None and self.required:
            return _error(400, "the Idempotency-Key header is required")
        try:
            g.db = psycopg.connect(self.conninfo, row_factory=namedtuple_row,
                                   connect_timeout=5)
        except psycopg.Error as err:
            return _unavailable(err)

        claim = {}
        if key is not None:
            claim = {"key": key, "scope": _scope()}
            try:
                row = self._claim(g.db, claim)
            except psycopg.Error as err:
                _rollback(g.db)
                # 22023: the key is empty, too long or has control characters.
                if err.sqlstate == "22023":
                    return _error(400, "the Idempotency-Key header is not a valid key")
                if not self.fail_open:
                    return _unavailable(err)
                log.error("idempotency: claim failed, running unguarded: %s", err)
                claim = {}
            else:
                if row.outcome != "new":
                    return _answer(row)
                claim["fence"] = row.fence
        # The view's transaction starts with its first statement on g.db.
        g.idempotency_pending = claim
        return None

    def _claim(self, conn, claim):
        """Claims the key in a transaction of its own, committed at once."""
        row = conn.execute(CLAIM, {
            **claim, "method": request.method, **_path_and_query(),
            "body": request.get_data(cache=True),
            "lease": self.lease, "retention": self.retention,
        }).fetchone()
        conn.commit()
        return row

    def _after(self, response):
        """Ends the view's transaction: complete and commit, or roll back and release."""
        claim = g.pop("idempotency_pending", None)
        if claim is None:
            return response
        conn = g.db
        try:
            if response.status_code >= 500:
                conn.rollback()
                if claim:
                    conn.execute(RELEASE, (claim["key"], claim["fence"], claim["scope"]))
                    conn.commit()
                return response
            if claim:
                conn.execute(COMPLETE, (claim["key"], claim["fence"],
                                        response.status_code, response.get_data(),
                                        Jsonb(self._headers_to_store(response)),
                                        claim["scope"]))
            conn.commit()
            return response
        except psycopg.Error as err:
            _rollback(conn)
            if err.sqlstate == "IK001":
                # The lease ran out and a retry took the key over: our writes
                # rolled back, and that retry's answer is the one that counts.
                return _error(409, "this request lost its claim to a retry; retry it",
                              {"Retry-After": "1"})
            if response.status_code >= 500:
                # The view's 500 goes out; the key stays claimed until its lease ends.
                return response
            # Nothing committed: free the key so that a retry runs again.
            if claim:
                try:
                    conn.execute(RELEASE, (claim["key"], claim["fence"], claim["scope"]))
                    conn.commit()
                except psycopg.Error:
                    pass
            log.error("idempotency: could not store the response: %s", err)
            return _error(503, "the database is unavailable; retry later", {"Retry-After": "1"})

    def _teardown(self, exc):
        """Closes the request's connection; a claim still pending is released."""
        conn = g.pop("db", None)
        if conn is None:
            return
        claim = g.pop("idempotency_pending", None)
        try:
            _rollback(conn)
            if claim:
                # Only when the view raised and Flask propagated it (debug mode).
                conn.execute(RELEASE, (claim["key"], claim["fence"], claim["scope"]))
                conn.commit()
        except psycopg.Error as err:
            log.error("idempotency: could not release the key: %s", err)
        finally:
            conn.close()

    def _headers_to_store(self, response):
        """Picks the response headers that a replay repeats."""
        stored = {}
        for name in self.store_headers:
            values = response.headers.getlist(name)
            if values:
                stored[name] = values[0] if len(values) == 1 else values
        return stored


def _scope():
    """Returns the caller's scope: a hash of its credential, never the credential."""
    for name in ("authorization", "x-api-key"):
        credential = request.headers.get(name)
        if credential is not None:
            return hashlib.sha256(f"{name}:{credential}".encode()).hexdigest()
    return ""


def _path_and_query():
    """Returns the request's raw path and query (None when there is none)."""
    raw = request.environ.get("RAW_URI") or request.full_path
    path, _, query = raw.partition("?")
    return {"path": path, "query": query or None}


def _answer(row):
    """Answers a claim that did not win: replay, in_progress or mismatch."""
    if row.outcome == "replay":
        response = Response(bytes(row.body or b""), status=row.status_code,
                            headers=row.headers or {})
        response.headers["Idempotent-Replayed"] = "true"
        return response
    if row.outcome == "in_progress":
        return _error(409, "a request with this Idempotency-Key is in progress",
                      {"Retry-After": str(row.retry_after)})
    if row.outcome == "mismatch":
        return _error(422, "this Idempotency-Key was used with a different request")
    raise RuntimeError(f"unexpected claim outcome {row.outcome}")


def _unavailable(err):
    """Fails closed: without the database, a retry could run twice."""
    log.error("idempotency: database unavailable: %s", err)
    return _error(503, "the database is unavailable; retry later", {"Retry-After": "1"})


def _error(status, message, headers=None):
    """Returns a JSON error response."""
    response = jsonify(error=message)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _rollback(conn):
    """Rolls back, ignoring a connection that is already gone."""
    try:
        conn.rollback()
    except psycopg.Error:
        pass
