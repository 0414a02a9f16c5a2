"""The retried-payment API: POST /payments charges once per Idempotency-Key.

Environment: DATABASE_URL (a database with CREATE EXTENSION idempotency
done), PORT (default 5000), HOST (default 127.0.0.1); for the tests,
IDEMPOTENCY_LEASE (default 60 seconds) and IDEMPOTENCY_FAIL_OPEN=on.
"""

import os
import time

import psycopg
from flask import Flask, g, request

from idempotency_middleware import Idempotency

DATABASE_URL = os.environ.get("DATABASE_URL", "")

app = Flask(__name__)
Idempotency(app, conninfo=DATABASE_URL,
            lease=os.environ.get("IDEMPOTENCY_LEASE", "60 seconds"),
            fail_open=os.environ.get("IDEMPOTENCY_FAIL_OPEN") == "on")


@app.get("/")
def health():
    """Answers without touching the database."""
    return {"status": "ok"}


@app.post("/payments")
def create_payment():
    """Charges the amount. Test knobs: delay_ms sleeps first, fail answers 500
    after the charge was written (the middleware rolls it back)."""
    data = request.get_json(silent=True) or {}
    amount = data.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
        return {"error": "amount must be a positive number"}, 400
    if data.get("delay_ms", 0) > 0:
        time.sleep(data["delay_ms"] / 1000)
    charge = g.db.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                          (amount,)).fetchone().id
    if data.get("fail"):
        return {"error": f"charge {charge} was declined"}, 500
    return {"charge": charge}, 201


def create_schema():
    """Creates the business table when missing."""
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            amount numeric NOT NULL,
                            created_at timestamptz NOT NULL DEFAULT now())""")


if __name__ == "__main__":
    create_schema()
    app.run(host=os.environ.get("HOST", "127.0.0.1"),
            port=int(os.environ.get("PORT", "5000")), threaded=True)
