"""The same small payment API on Flask and on FastAPI, each behind its
middleware, served over real HTTP on 127.0.0.1 for the tests.

POST /payments {"amount": N, "delay_ms": D, "fail": true, "raise": true,
"status": S, "after_ms": A} inserts a charge and answers 201 {"charge": id}
(500 with fail, an exception with raise, S with status; after_ms: sleeps
after the charge). POST /headers answers 200 with headers that may or
may not be stored. GET and PUT /db tell whether the handler got a connection;
POST /prepared lists the statements prepared on it.
"""

import asyncio
import contextlib
import socket
import threading
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from flask import Flask, g, request
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from werkzeug.serving import make_server

from pg_idempotency.asgi import IdempotencyMiddleware
from pg_idempotency.flask import Idempotency

# The statements prepared on a connection (POST /prepared).
PREPARED = """SELECT pg_catalog.json_build_object('statement', statement, 'prepared', prepare_time)
                FROM pg_catalog.pg_prepared_statements"""
EXTRA_HEADERS = {"Location": "/payments/7", "Set-Cookie": "session=secret",
                 "X-Request-Id": "r-1"}


def flask_app(pool, **options):
    """Returns the Flask app, guarded by the extension with options."""
    app = Flask("payments")
    Idempotency(app, pool=pool, **options)

    @app.post("/payments")
    @app.patch("/payments")
    def pay():
        """Charges; test knobs delay_ms, after_ms, fail, raise, status."""
        data = request.get_json(silent=True) or {}
        time.sleep(data.get("delay_ms", 0) / 1000)
        charge = g.db.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                              (data.get("amount", 1),)).fetchone()[0]
        if data.get("raise"):
            raise RuntimeError("the handler failed")
        time.sleep(data.get("after_ms", 0) / 1000)
        if data.get("fail"):
            return {"error": f"charge {charge} was declined"}, 500
        return {"charge": charge}, data.get("status", 201)

    @app.post("/headers")
    def headers():
        """Answers with headers of every kind, and binary bytes."""
        return b"\x00\xffbinary", 200, {**EXTRA_HEADERS, "Content-Type": "application/octet-stream"}

    @app.route("/db", methods=["GET", "PUT"])
    def db():
        """Tells whether a connection was given."""
        return {"db": g.get("db") is not None}

    @app.post("/prepared")
    def prepared():
        """Lists the statements prepared on the request's connection."""
        return {"statements": [row[0] for row in g.db.execute(PREPARED, prepare=False)]}

    return app


def asgi_app(pool, inner=(), outer=(), **options):
    """Returns the FastAPI app, behind the ASGI middleware with options;
    inner and outer: (middleware class, its options) to add between the
    middleware and the routes, or around the middleware, innermost first."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        """Opens the pool inside the server's event loop, closes it at shutdown."""
        async with pool:
            yield

    app = FastAPI(lifespan=lifespan)
    # Starlette runs the middleware added last outermost.
    for middleware, middleware_options in inner:
        app.add_middleware(middleware, **middleware_options)
    app.add_middleware(IdempotencyMiddleware, pool=pool, **options)
    for middleware, middleware_options in outer:
        app.add_middleware(middleware, **middleware_options)

    def transaction(request: Request):
        """The dependency that hands an endpoint the request's transaction."""
        return request.state.db

    @app.api_route("/payments", methods=["POST", "PATCH"])
    async def pay(request: Request, db=Depends(transaction)):
        """Charges; test knobs delay_ms, after_ms, fail, raise, status."""
        data = await request.json() if await request.body() else {}
        await asyncio.sleep(data.get("delay_ms", 0) / 1000)
        cur = await db.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                               (data.get("amount", 1),))
        charge = (await cur.fetchone())[0]
        if data.get("raise"):
            raise RuntimeError("the handler failed")
        await asyncio.sleep(data.get("after_ms", 0) / 1000)
        if data.get("fail"):
            return JSONResponse({"error": f"charge {charge} was declined"}, status_code=500)
        return JSONResponse({"charge": charge}, status_code=data.get("status", 201))

    @app.post("/headers")
    async def headers():
        """Answers with headers of every kind, and binary bytes."""
        return Response(b"\x00\xffbinary", headers=EXTRA_HEADERS,
                        media_type="application/octet-stream")

    @app.api_route("/db", methods=["GET", "PUT"])
    async def db(request: Request):
        """Tells whether a connection was given."""
        return {"db": getattr(request.state, "db", None) is not None}

    @app.post("/prepared")
    async def prepared(db=Depends(transaction)):
        """Lists the statements prepared on the request's connection."""
        return {"statements": [row[0] for row in await (await db.execute(PREPARED, prepare=False)).fetchall()]}

    return app


class FlaskServer:
    """A Flask app on a pool, served by werkzeug in a thread."""

    def __init__(self, conninfo, pool_options, options):
        """Opens the pool and starts serving on a free port."""
        self.pool = ConnectionPool(conninfo, **pool_options)
        self.server = make_server("127.0.0.1", 0, flask_app(self.pool, **options), threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self):
        """Stops serving and closes the pool."""
        self.server.shutdown()
        self.thread.join()
        self.pool.close()


class UvicornServer:
    """An ASGI app served by uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app, lifespan="on"):
        """Starts serving; returns once uvicorn has started."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, lifespan=lifespan, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self):
        """Stops serving (an app with a lifespan closes its pool then)."""
        self.server.should_exit = True
        self.thread.join()


class AsgiServer(UvicornServer):
    """A FastAPI app on an async pool, served by uvicorn in a thread."""

    def __init__(self, conninfo, pool_options, options):
        """Starts serving on a free port; the app opens its pool at startup."""
        self.pool = AsyncConnectionPool(conninfo, open=False, **pool_options)
        super().__init__(asgi_app(self.pool, **options))


SERVERS = {"flask": FlaskServer, "asgi": AsgiServer}
