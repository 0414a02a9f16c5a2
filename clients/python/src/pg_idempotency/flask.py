"""Flask extension: Idempotency-Key on the idempotency PostgreSQL extension.

For each covered request it takes a connection from the pool, claims the
key (committed at once, so that a concurrent retry sees it), lets the view
write through ``g.db`` in a transaction, and stores the view's response with
idempotency.complete() in that transaction: the business writes and the
stored response commit together.
"""

from __future__ import annotations

from typing import Optional

import psycopg
from flask import Response, g, request

from . import contract
from .client import ClaimLost, Client


class _Answer(Response):
    """A response with exactly the headers given (no default Content-Type)."""
    default_mimetype = None


class Idempotency:
    """Guards the app's POST and PATCH requests with Idempotency-Key."""

    def __init__(self, app=None, *, pool, **options):
        """pool: a psycopg_pool.ConnectionPool; options: see contract.Options."""
        self.pool = pool
        self.client = Client(pool)
        self.options = contract.Options(**options)
        if app is not None:
            self.init_app(app)

    def init_app(self, app) -> None:
        """Registers the hooks around every request of app."""
        app.before_request(self._before)
        app.after_request(self._after)
        app.teardown_request(self._teardown)

    def _before(self):
        """Claims the key: answers here, or lets the view run on g.db."""
        if request.method not in self.options.methods:
            return None
        headers = _headers()
        key, refusal = contract.read_key(headers, self.options)
        if refusal:
            return _response(refusal)
        try:
            g.db = self.pool.getconn()
        except psycopg.Error as err:
            return self._unguarded(err, None)
        g.db_autocommit = g.db.autocommit
        g.db.autocommit = False
        if key is None:
            g.idempotency = contract.Pending()
            return None
        scope = self.options.scope(request) if self.options.scope else contract.credential_scope(headers)
        try:
            claim = self.client.claim(key, _fingerprint(), scope=scope, lease=self.options.lease,
                                      retention=self.options.retention, conn=g.db, commit=True)
        except psycopg.Error as err:
            refusal = contract.refused_key(err)
            return _response(refusal) if refusal else self._unguarded(err, g.db)
        answer = contract.answer_claim(claim)
        if answer:
            return _response(answer)
        g.idempotency = contract.Pending(key, scope, claim.fence)
        return None

    def _unguarded(self, err: Exception, conn):
        """After a failure of the store: 503, or with fail_open the view runs unguarded."""
        if not self.options.fail_open:
            return _response(contract.unavailable(err))
        contract.log.error("idempotency: running unguarded: %s", err)
        g.db = conn
        g.idempotency = contract.Pending()
        return None

    def _after(self, response):
        """Ends the view's transaction: complete and commit; a 5xx is left to _teardown."""
        pending = g.get("idempotency")
        conn = g.get("db")
        if pending is None or conn is None:
            return response
        if response.status_code >= 500:
            # _teardown ends it: there Flask says whether the view raised.
            g.idempotency_failed = contract.Answer(response.status_code, list(response.headers.items()),
                                                   response.get_data())
            return response
        g.pop("idempotency")
        try:
            if pending.fence is None:
                conn.commit()
            else:
                self.client.complete(
                    pending.key, pending.fence, response.status_code, response.get_data(),
                    contract.headers_to_store(response.headers.items(), self.options),
                    scope=pending.scope, conn=conn, commit=True)
        except ClaimLost:
            # Its writes roll back in _teardown, before the answer goes out.
            return _response(contract.claim_lost())
        except psycopg.Error as err:
            self._abandon(conn, pending)
            return _response(contract.unavailable(err))
        return response

    def _abandon(self, conn, pending: contract.Pending,
                 failed: Optional[contract.Answer] = None) -> None:
        """Rolls the view's writes back and ends the claim: a 5xx response
        (failed) goes to complete, which releases the key or, with
        idempotency.store_server_errors on, stores the response; otherwise,
        or when complete fails, the key is released for the next retry."""
        try:
            conn.rollback()
        except psycopg.Error as err:
            contract.log.error("idempotency: could not roll back %r: %s", pending.key, err)
            return  # a broken connection: the key frees itself when its lease ends
        if pending.fence is None:
            return
        if failed is not None:
            try:
                self.client.complete(pending.key, pending.fence, failed.status, failed.body,
                                     contract.headers_to_store(failed.headers, self.options),
                                     scope=pending.scope, conn=conn, commit=True)
                return
            except ClaimLost:
                return  # a retry owns the key: nothing of ours to free
            except psycopg.Error as err:  # 54000 (too large to store) among others
                contract.log.error("idempotency: could not end the claim of %r after a %d: %s",
                                   pending.key, failed.status, err)
        try:
            self.client.release(pending.key, pending.fence, scope=pending.scope,
                                conn=conn, commit=True)
        except psycopg.Error as err:
            contract.log.error("idempotency: could not release %r: %s", pending.key, err)

    def _teardown(self, exc) -> None:
        """Returns the connection to the pool, after ending a claim still
        pending: a view that raised releases it; a 5xx it answered goes to complete."""
        conn = g.pop("db", None)
        if conn is None:
            return
        pending = g.pop("idempotency", None)
        failed = g.pop("idempotency_failed", None)
        if pending is not None:
            self._abandon(conn, pending, failed if exc is None else None)
        try:
            conn.rollback()
            conn.autocommit = g.pop("db_autocommit")
        except psycopg.Error:
            pass  # a broken connection: the pool discards it
        self.pool.putconn(conn)


def _headers() -> contract.Headers:
    """Returns the request's headers as (lowercase name, raw bytes) pairs."""
    return [(name.lower(), value.encode("latin-1")) for name, value in request.headers.items()]


def _fingerprint() -> bytes:
    """Returns the fingerprint of the request as sent: raw target and body."""
    return contract.wsgi_fingerprint(request.environ, request.method, request.get_data(cache=True))


def _response(answer: contract.Answer) -> Response:
    """Turns an answer of the contract into a Flask response."""
    return _Answer(answer.body, status=answer.status, headers=answer.headers)
