"""The retried-payment API: POST /payments charges once per Idempotency-Key;
POST /webhooks charges once per Standard Webhooks event.

Environment: DATABASE_URL (a database with CREATE EXTENSION idempotency
done), PORT (default 5000), HOST (default 127.0.0.1), WEBHOOK_SECRET (the
webhook endpoint's secret, whsec_...; without it POST /webhooks answers 503); for the tests,
IDEMPOTENCY_LEASE (unset: the database's idempotency.lease), IDEMPOTENCY_FAIL_OPEN=on,
IDEMPOTENCY_ONE_TRANSACTION=on (the one-transaction mode) and IDEMPOTENCY_PREPARE=on
(the prepare option, for clients/python/bench/overhead).
"""

import os
import time

from flask import Blueprint, Flask, g, request
from psycopg.rows import namedtuple_row
from psycopg_pool import ConnectionPool

from pg_idempotency.flask import Idempotency, exempt
from pg_idempotency.webhooks import standard_webhook

DATABASE_URL = os.environ.get("DATABASE_URL", "")

# Opened in main(); a request waits at most 5 seconds for a connection.
pool = ConnectionPool(DATABASE_URL, min_size=2, max_size=10, timeout=5, open=False,
                      kwargs={"row_factory": namedtuple_row, "connect_timeout": 5})
app = Flask(__name__)


@app.before_request
def authenticate():
    """Your authentication goes here, before the idempotency hook: it sets
    g.account to the account id the caller authenticated as (a session, an
    OAuth token's subject, an API key's owner). This example has no
    accounts, so it sets None."""
    g.account = None


def key_scope(req):
    """Whose keys these are: the authenticated account, which stays the same
    when its OAuth token is refreshed. None keeps the default, a hash of the
    Authorization header: a refreshed token would then be a new scope, and a
    retry sent with it would run again."""
    return g.account


# Registered after authenticate(): Flask runs before_request hooks in order.
# IDEMPOTENCY_ONE_TRANSACTION=on: the claim, the charge and the stored
# response in one transaction (the charge is all in this database).
Idempotency(app, pool=pool, scope=key_scope,
            lease=os.environ.get("IDEMPOTENCY_LEASE") or None,  # None: idempotency.lease
            fail_open=os.environ.get("IDEMPOTENCY_FAIL_OPEN") == "on",
            one_transaction=os.environ.get("IDEMPOTENCY_ONE_TRANSACTION") == "on",
            prepare=os.environ.get("IDEMPOTENCY_PREPARE") == "on")


@app.get("/")
def health():
    """Answers without touching the database."""
    return {"status": "ok"}


def invalid_amount(data):
    """Why data's amount cannot be charged, or None."""
    amount = data.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
        return "amount must be a positive number"
    return None


def charge(conn, data):
    """Charges data's amount on conn, after data's delay_ms; returns the charge's id."""
    delay_ms = data.get("delay_ms", 0)
    if isinstance(delay_ms, (int, float)) and delay_ms > 0:
        time.sleep(delay_ms / 1000)
    return conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                        (data["amount"],)).fetchone().id


@app.post("/payments")
def create_payment():
    """Charges the amount. Test knobs: delay_ms sleeps first, fail answers 500
    after the charge was written (the middleware rolls it back)."""
    data = request.get_json(silent=True) or {}
    if invalid_amount(data):
        return {"error": invalid_amount(data)}, 400
    charge_id = charge(g.db, data)
    if data.get("fail"):
        return {"error": f"charge {charge_id} was declined"}, 500
    return {"charge": charge_id}, 201


# POST /webhooks: the sender's deliveries, guarded by the extension with the
# Standard Webhooks key source on a blueprint of their own: verified before
# any claim (401 otherwise), the key their webhook-id, the scope "webhook:"
# and the sender.
# IDEMPOTENCY_ONE_TRANSACTION=on: the claim commits with the charge.
webhooks = Blueprint("webhooks", __name__)


@webhooks.post("/webhooks")
def receive_webhook():
    """Charges a Standard Webhooks event's data.amount (data.delay_ms sleeps
    first) once: 200 {"charge": N} (a redelivery gets the same), 401
    unverified, 400, stored, for an event without a positive amount; 409
    while it runs, 422 when its webhook-id came with another payload."""
    payload = request.get_json(silent=True, force=True)
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, dict) or invalid_amount(data):
        return {"error": "data.amount must be a positive number"}, 400
    return {"charge": charge(g.db, data)}, 200


if os.environ.get("WEBHOOK_SECRET"):
    Idempotency(webhooks, pool=pool,
                one_transaction=os.environ.get("IDEMPOTENCY_ONE_TRANSACTION") == "on",
                **standard_webhook(os.environ["WEBHOOK_SECRET"], sender="payments-provider"))
    app.register_blueprint(webhooks)
else:
    @app.post("/webhooks")
    @exempt
    def webhooks_unset():
        """Without a secret no delivery can be verified."""
        return {"error": "WEBHOOK_SECRET is not set"}, 503


def main():
    """Opens the pool, creates the business table when missing, and serves."""
    pool.open(wait=True)
    with pool.connection() as conn:
        conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            amount numeric NOT NULL,
                            created_at timestamptz NOT NULL DEFAULT now())""")
    app.run(host=os.environ.get("HOST", "127.0.0.1"),
            port=int(os.environ.get("PORT", "5000")), threaded=True)


if __name__ == "__main__":
    main()
