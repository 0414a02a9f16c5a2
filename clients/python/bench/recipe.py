"""The hand-written recipe, with no idempotency library: what a careful team
writes with psycopg before it reaches for one, the yardstick of
overhead.py. In one transaction, INSERT ... ON CONFLICT DO NOTHING claims
(scope, key) in a table of its own; when it inserted, the route's work and
the UPDATE that stores the response; when it did not (the key committed
before, or a concurrent duplicate waited on the unique index until it
did), the SELECT of the stored response: replayed when the request hash is
the same, else 422. Scoped per caller (a hash of the credential). An error
or a 5xx rolls the claim back with the work, so that a retry runs again;
so does a crash. One Flask and one ASGI (FastAPI) form.
"""

import hashlib

TABLE = """CREATE TABLE IF NOT EXISTS recipe_keys (
    scope text NOT NULL, key text NOT NULL, request_hash bytea NOT NULL,
    status text NOT NULL DEFAULT 'started', response_code int, response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))"""
CLAIM = "INSERT INTO recipe_keys (scope, key, request_hash) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"
STORED = "SELECT request_hash, status, response_code, response_body FROM recipe_keys WHERE scope = %s AND key = %s"
STORE = ("UPDATE recipe_keys SET status = 'completed', response_code = %s, response_body = %s"
         " WHERE scope = %s AND key = %s")


def identify(headers, method, path, body):
    """(key, scope, request hash) of a request; key None when it has none or a bad one."""
    key = headers.get("Idempotency-Key")
    if not key or len(key) > 255:
        key = None
    scope = hashlib.sha256(headers.get("Authorization", "").encode("latin-1")).hexdigest()
    return key, scope, hashlib.sha256(f"{method} {path}\n".encode() + body).digest()


def decide(row, request_hash):
    """The answer to a key that was there: (status, body, replayed)."""
    stored_hash, status, code, body = row
    if bytes(stored_hash) != request_hash:
        return 422, b'{"error":"key reused"}', False
    if status != "completed":
        return 409, b'{"error":"in progress"}', False
    return code, bytes(body), True


def flask_view(pool, view):
    """A Flask view that runs view() under the recipe, with g.db the request's transaction."""
    from flask import Response, current_app, g, request

    def pay():
        """The recipe around view()."""
        key, scope, request_hash = identify(request.headers, request.method, request.path, request.get_data())
        if key is None:
            return {"error": "Idempotency-Key required"}, 400
        with pool.connection() as conn:  # BEGIN ... COMMIT on leaving, ROLLBACK on an exception
            if conn.execute(CLAIM, (scope, key, request_hash)).rowcount == 0:
                status, body, replayed = decide(conn.execute(STORED, (scope, key)).fetchone(), request_hash)
                headers = {"Idempotent-Replayed": "true"} if replayed else {}
                return Response(body, status, headers, content_type="application/json")
            g.db = conn
            response = current_app.make_response(view())
            if response.status_code >= 500:
                conn.rollback()
            else:
                conn.execute(STORE, (response.status_code, response.get_data(), scope, key))
            return response
    return pay


def asgi_route(pool, work):
    """A FastAPI route that runs await work(db, request) (a response) under the recipe."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    async def pay(request: Request):
        """The recipe around work()."""
        key, scope, request_hash = identify(request.headers, request.method, request.url.path, await request.body())
        if key is None:
            return JSONResponse({"error": "Idempotency-Key required"}, status_code=400)
        async with pool.connection() as conn:  # BEGIN ... COMMIT on leaving, ROLLBACK on an exception
            if (await conn.execute(CLAIM, (scope, key, request_hash))).rowcount == 0:
                row = await (await conn.execute(STORED, (scope, key))).fetchone()
                status, body, replayed = decide(row, request_hash)
                headers = {"Idempotent-Replayed": "true"} if replayed else {}
                return Response(body, status, headers, media_type="application/json")
            response = await work(conn, request)
            if response.status_code >= 500:
                await conn.rollback()
            else:
                await conn.execute(STORE, (response.status_code, response.body, scope, key))
            return response
    return pay
