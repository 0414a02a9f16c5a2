"""Flask extension: Idempotency-Key on the idempotency PostgreSQL extension.

For each covered request it takes a connection from the pool, claims the
key (committed at once, so that a concurrent retry sees it), lets the view
write through ``g.db`` in a transaction, and stores the view's response with
idempotency.complete() in that transaction: the business writes and the
stored response commit together.
"""

from __future__ import annotations

import uuid
from typing import Optional, Tuple

import psycopg
from flask import Blueprint, Response, current_app, g, request

from . import contract, flow
from .client import Claim, ClaimLost, Client


class _Answer(Response):
    """A response with exactly the headers given (no default Content-Type)."""
    default_mimetype = None


class Idempotency:
    """Guards the app's POST and PATCH requests with Idempotency-Key."""

    def __init__(self, app=None, *, pool, **options):
        """pool: a psycopg_pool.ConnectionPool; options: see contract.Options."""
        self.pool = pool
        self.options = contract.Options(**options)
        self.client = Client(pool, tracer_provider=self.options.tracer_provider,
                             prepare=self.options.prepare)
        if app is not None:
            self.init_app(app)

    def init_app(self, app) -> None:
        """Registers the hooks around every request of app, or of a Blueprint:
        then the blueprint's requests are this instance's, not the app's
        (e.g. a webhook receiver's, with webhooks.standard_webhook's options)."""
        app.before_request(self._before)
        app.after_request(self._after)
        app.teardown_request(self._teardown)
        if isinstance(app, Blueprint):
            app.idempotency_guard = self

    def _covers(self) -> bool:
        """True when this instance guards the request: a method it covers, not
        exempt, and not a request of a blueprint that has its own instance."""
        if not contract.covers(self.options, request.method, request):
            return False
        if getattr(current_app.view_functions.get(request.endpoint), "idempotency_exempt", False):
            return False
        guards = [getattr(current_app.blueprints.get(name), "idempotency_guard", None)
                  for name in request.blueprints]
        return next((guard for guard in guards if guard is not None), self) is self

    def _before(self):
        """Claims the key: answers here, or lets the view run on g.db."""
        if not self._covers():
            return None
        g.idempotency_guard = self
        headers = _headers()
        key, scope, refusal = contract.identify(self.options, request, headers,
                                                request.get_data(cache=True))
        if refusal:
            return _response(refusal)
        if key is None:
            try:
                self._take(begin=True)
            except psycopg.Error as err:
                return self._unguarded(err)
            g.idempotency = contract.Pending()
            return None
        pending = contract.Pending(key, scope, None, uuid.uuid4(), _fingerprint())
        try:
            claim, asked_again = self._claim(pending)
        except psycopg.Error as err:
            refusal = contract.refused_key(err)
            return _response(refusal) if refusal else self._unguarded(err)
        answer = contract.answer_claim(claim, asked_again and self.options.one_transaction)
        if answer:
            return _response(answer)
        g.idempotency = pending._replace(fence=claim.fence)
        return None

    def _take(self, begin: bool = False):
        """Gives the request a fresh connection of the pool, as g.db (the one
        it had goes back), in autocommit: the extension sends BEGIN itself,
        with the claim (psycopg's own BEGIN would cost a round trip of its
        own), or at once with begin."""
        self._give_back()
        g.db = self.pool.getconn()
        g.db_autocommit = g.db.autocommit
        g.db.autocommit = True
        if begin:
            g.db.execute("BEGIN", prepare=False)
        return g.db

    def _give_back(self) -> None:
        """Returns g.db to the pool idle, in its own autocommit mode (a broken one is discarded)."""
        conn = g.pop("db", None)
        if conn is None:
            return
        try:
            flow.roll_back(conn, self.client.prepare)
            conn.autocommit = g.pop("db_autocommit")
        except psycopg.Error:
            pass  # a broken connection: the pool discards it
        self.pool.putconn(conn)

    def _claim(self, pending: contract.Pending) -> Tuple[Claim, bool]:
        """Claims with the request's token on a fresh g.db (flow.claim_answered)."""
        return flow.claim_answered(self.client, pending, self.options, self._take, self._give_back,
                                   self.pool.check)

    def _unguarded(self, err: Exception):
        """After a failure of the store: 503, or with fail_open the view runs unguarded."""
        if not self.options.fail_open:
            self._give_back()
            return _response(contract.unavailable(err))
        contract.log.error("idempotency: running unguarded: %s", err)
        try:
            self._take(begin=True)
        except psycopg.Error:
            g.db = None
        g.idempotency = contract.Pending()
        return None

    def _after(self, response):
        """Ends the view's transaction: complete and commit; a 5xx is left to
        _teardown (as is the ROLLBACK of the claim's own answer's transaction:
        not after the answer, through call_on_close, which a test client
        that does not close its responses would never call)."""
        pending = g.get("idempotency")
        if g.get("idempotency_guard") is not self or pending is None or g.get("db") is None:
            return response
        return self._finish(pending, response)

    def _finish(self, pending: contract.Pending, response):
        """Completes and commits. When the COMMIT's answer is lost, claims
        again with the token: replay means it committed (the view's response
        goes out); new means it rolled back, and the view runs again on a
        fresh g.db, at most contract.RERUNS times."""
        for rerun in range(1 + contract.RERUNS):
            if rerun:
                response = current_app.make_response(current_app.dispatch_request())
            if contract.unfinished(response.status_code):
                return response    # _teardown rolls back and releases the key
            if response.status_code >= 500:
                # _teardown ends it: there Flask says whether the view raised.
                g.idempotency_failed = contract.Answer(
                    response.status_code, list(response.headers.items()), response.get_data())
                return response
            try:
                pending = contract.with_stored(pending, contract.Answer(
                    response.status_code, list(response.headers.items()), response.get_data()), self.options)
                self._commit(pending)
                return _done(response)
            except ClaimLost:
                return _done(_response(contract.claim_lost()))   # _teardown rolls back
            except contract.RedactFailed as err:
                return _response(contract.redact_failed(pending, err))   # _teardown releases the key
            except psycopg.Error as err:
                if pending.fence is None or not contract.answer_lost(err):
                    self._abandon(g.db, _done(pending))
                    return _response(contract.unavailable(err))
                lost = err
            try:
                claim, _ = self._claim(pending)
            except psycopg.Error as again:
                return _done(_response(contract.outcome_unknown(again)))
            after, pending = flow.after_reclaim(claim, pending, response, self.options)
            if after is not None:
                return _done(response if after is response else _response(after))
            g.idempotency = pending
        return _response(contract.outcome_unknown(lost))    # _teardown releases the claim

    def _commit(self, pending: contract.Pending) -> None:
        """Stores pending.stored with complete() and commits the view's transaction."""
        if pending.fence is None:
            g.db.commit()
            return
        stored = pending.stored
        self.client.complete(pending.key, pending.fence, stored.status, stored.body, stored.headers,
                             scope=pending.scope, conn=g.db, commit=True)

    def _abandon(self, conn, pending: contract.Pending,
                 failed: Optional[contract.Answer] = None) -> None:
        """Rolls the view's writes back and ends the claim (flow.abandon)."""
        flow.abandon(self.client, conn, pending, self.options, failed)

    def _teardown(self, exc) -> None:
        """Returns the connection to the pool, after ending a claim still
        pending: a view that raised releases it; a 5xx it answered goes to complete."""
        if g.get("idempotency_guard") is not self:
            return
        pending = g.pop("idempotency", None)
        failed = g.pop("idempotency_failed", None)
        if pending is not None and g.get("db") is not None:
            self._abandon(g.db, pending, failed if exc is None else None)
        self._give_back()


def exempt(view):
    """A decorator for a view the extension does not guard (a webhook
    receiver, whose key is the sender's event id: pg_idempotency.webhooks)."""
    view.idempotency_exempt = True
    return view


def _done(value):
    """Ends the request's claim in g (nothing is left for _teardown to end); returns value."""
    g.pop("idempotency", None)
    return value


def _headers() -> contract.Headers:
    """Returns the request's headers as (lowercase name, raw bytes) pairs."""
    return [(name.lower(), value.encode("latin-1")) for name, value in request.headers.items()]


def _fingerprint() -> bytes:
    """Returns the fingerprint of the request as sent: raw target and body."""
    return contract.wsgi_fingerprint(request.environ, request.method, request.get_data(cache=True))


def _response(answer: contract.Answer) -> Response:
    """Turns an answer of the contract into a Flask response."""
    return _Answer(answer.body, status=answer.status, headers=answer.headers)
