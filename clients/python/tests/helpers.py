"""What the tests share: callers, requests, and reading the database."""

import hashlib
import json
import time

ALICE = {"Authorization": "Bearer sk_test_alice"}
BOB = {"Authorization": "Bearer sk_test_bob"}


def scope_of(credential_headers):
    """Returns the scope the middlewares derive from an Authorization header."""
    return hashlib.sha256(b"authorization:" + credential_headers["Authorization"].encode()).hexdigest()


def pay(client, key, body=None, caller=ALICE, method="POST", path="/payments"):
    """Sends a payment; key is the Idempotency-Key field as sent (None: no
    field; a list: the field that many times); body a dict or raw bytes."""
    headers = list(caller.items()) + [("Content-Type", "application/json")]
    keys = [] if key is None else key if isinstance(key, list) else [key]
    headers += [("Idempotency-Key", k) for k in keys]
    content = body if isinstance(body, bytes) else json.dumps(body or {"amount": 10}).encode()
    return client.request(method, path, headers=headers, content=content)


def value(conn, sql, *params):
    """Returns the single value of a query."""
    return conn.execute(sql, params).fetchone()[0]


def assert_problem(response, status, code):
    """Checks an RFC 9457 problem answer with the contract's code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["status"] == status and problem["code"] == code
    assert problem["type"] == "about:blank"
    assert problem["title"] and problem["detail"]


def wait_for(admin, sql, *params, timeout=10):
    """Waits until a query answers true (bounded)."""
    deadline = time.monotonic() + timeout
    while not value(admin, sql, *params):
        assert time.monotonic() < deadline, f"timed out waiting for {sql}"
        time.sleep(0.02)
