"""Idempotency-Key for Python web apps, on the idempotency PostgreSQL extension.

- ``pg_idempotency.flask.Idempotency``: the Flask extension;
- ``pg_idempotency.django.IdempotencyMiddleware``: the Django middleware;
- ``pg_idempotency.asgi.IdempotencyMiddleware``: the ASGI middleware (FastAPI, Starlette);
- ``pg_idempotency.powertools.PostgresPersistenceLayer``: Powertools for AWS Lambda's persistence layer;
- ``idempotent_function``: any function (a job, a webhook event) run once per key;
- ``pg_idempotency.webhooks``: webhook receivers (Standard Webhooks, a key in the body);
- ``Client`` / ``AsyncClient``: the extension's functions for any other code;
- ``fingerprint``: the request hash, as ``idempotency.fingerprint()`` computes it.
"""

from .client import AsyncClient, Claim, ClaimLost, Client, Record
from .fingerprint import fingerprint
from .function import (AsyncRun, FinalError, IdempotencyError, InProgress, Mismatch, Run,
                       idempotent_function)

__all__ = ["AsyncClient", "AsyncRun", "Claim", "ClaimLost", "Client", "FinalError", "IdempotencyError",
           "InProgress", "Mismatch", "Record", "Run", "fingerprint", "idempotent_function"]
