"""Idempotency-Key for Python web apps, on the idempotency PostgreSQL extension.

- ``pg_idempotency.flask.Idempotency``: the Flask extension;
- ``pg_idempotency.django.IdempotencyMiddleware``: the Django middleware;
- ``pg_idempotency.asgi.IdempotencyMiddleware``: the ASGI middleware (FastAPI, Starlette);
- ``pg_idempotency.powertools.PostgresPersistenceLayer``: Powertools for AWS Lambda's persistence layer;
- ``Client`` / ``AsyncClient``: the extension's functions for any other code;
- ``fingerprint``: the request hash, as ``idempotency.fingerprint()`` computes it.
"""

from .client import AsyncClient, Claim, ClaimLost, Client, Record
from .fingerprint import fingerprint

__all__ = ["AsyncClient", "Claim", "ClaimLost", "Client", "Record", "fingerprint"]
