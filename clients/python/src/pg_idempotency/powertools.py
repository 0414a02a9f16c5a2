"""A persistence layer for Powertools for AWS Lambda (Python)'s idempotency
utility, on the idempotency PostgreSQL extension.

    from aws_lambda_powertools.utilities.idempotency import idempotent
    from pg_idempotency.powertools import PostgresPersistenceLayer

    persistence = PostgresPersistenceLayer(ConnectionPool(DATABASE_URL, min_size=0, max_size=1))

    @idempotent(persistence_store=persistence)
    def handler(event, context): ...

Powertools' calls map onto the extension's functions:

- save_inprogress is claim: ``new`` runs the function (its fence is kept for
  the calls that end it); ``replay`` hands Powertools the stored response;
  ``in_progress`` is Powertools' in-progress error; ``mismatch`` is its
  validation error. The check and the insert are one atomic claim, so of
  concurrent invocations exactly one runs.
- The claim's lease is Powertools' in-progress expiry: the time the Lambda
  invocation has left (``config.register_lambda_context``), so that an
  invocation that timed out is taken over by the next one; without a
  registered context, the whole record expiry, as Powertools does. The
  lease never outlasts the record expiry: Powertools' DynamoDB layer
  overwrites a record once either has passed, so a record counts as absent
  after ``expires_after_seconds`` whatever time the invocation had left.
- save_success is complete (the result's JSON stored as the body); an
  exception's delete_record is release.
- The record's retention is Powertools' ``expires_after_seconds``, counted
  from the claim; the database's clock decides, never the function's.
- Payload validation (``payload_validation_jmespath``): the hash of the
  validated part is the record's fingerprint, so a claim with another payload
  is the extension's ``mismatch``. Without validation every payload of a key
  has the same fingerprint.
- The local cache (``use_local_cache``) is Powertools' own, in the base class.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from datetime import timedelta
from typing import Optional

from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyItemAlreadyExistsError,
    IdempotencyItemNotFoundError,
    IdempotencyValidationError,
)
from aws_lambda_powertools.utilities.idempotency.persistence.base import BasePersistenceLayer
from aws_lambda_powertools.utilities.idempotency.persistence.datarecord import (
    STATUS_CONSTANTS,
    DataRecord,
)

from .client import Claim, Client, Record

# The fingerprint of every payload when payload validation is off.
ANY_PAYLOAD = b"\x00"
MAX_FINGERPRINT_BYTES = 64
# The shortest lease: an invocation with no time left still claims.
MIN_LEASE = timedelta(milliseconds=1)


class PostgresPersistenceLayer(BasePersistenceLayer):
    """Powertools' idempotency records kept by the idempotency extension."""

    def __init__(self, pool, *, scope: Optional[str] = None, tracer_provider=None):
        """pool: a psycopg_pool.ConnectionPool on a database with the
        extension; scope: the records' scope (None: the idempotency.scope
        setting, '' when unset); tracer_provider: OpenTelemetry's for the
        spans (None: the global one)."""
        super().__init__()
        self.client = Client(pool, tracer_provider=tracer_provider)
        self.scope = scope
        # The fences of the claims this thread's invocations hold, by key:
        # an invocation that timed out and one that took its key over never
        # see each other's.
        self._claims = threading.local()

    def _put_record(self, data_record: DataRecord) -> None:
        """Claims the key: returns when this invocation runs the function,
        else raises what Powertools expects for the record found."""
        retention = timedelta(seconds=self.expires_after_seconds)
        claim = self.client.claim(data_record.idempotency_key, _fingerprint(data_record.payload_hash),
                                  scope=self.scope, lease=_lease(data_record, retention),
                                  retention=retention)
        if claim.outcome == "new":
            self._held()[data_record.idempotency_key] = claim.fence
            return
        if claim.outcome == "mismatch":
            raise IdempotencyValidationError("Payload does not match stored record for this event key")
        found = _claimed_record(data_record, claim, retention)
        self._save_to_cache(data_record=found)   # a completed one only
        raise IdempotencyItemAlreadyExistsError(old_data_record=found)

    def _update_record(self, data_record: DataRecord) -> None:
        """Stores the function's result and ends the claim (ClaimLost when
        the lease ended and another invocation took the key over)."""
        fence = self._fence(data_record.idempotency_key)
        self.client.complete(data_record.idempotency_key, fence, 200,
                             data_record.response_data.encode(), scope=self.scope)

    def _delete_record(self, data_record: DataRecord) -> None:
        """Releases this invocation's claim, so that the next one runs again.
        A record this process holds no claim of (a completed one) stays:
        completed records are immutable until they expire."""
        fence = self._held().pop(data_record.idempotency_key, None)
        if fence is not None:
            self.client.release(data_record.idempotency_key, fence, scope=self.scope)

    def _get_record(self, idempotency_key) -> DataRecord:
        """Reads the record as claim would see it (lookup: no write)."""
        record = self.client.lookup(idempotency_key, scope=self.scope)
        if record is None:
            raise IdempotencyItemNotFoundError
        return _looked_up_record(record)

    def _held(self) -> dict:
        """The fences of this thread's claims, by key."""
        if not hasattr(self._claims, "fences"):
            self._claims.fences = {}
        return self._claims.fences

    def _fence(self, idempotency_key: str) -> int:
        """Takes the fence of this process's claim of the key."""
        try:
            return self._held().pop(idempotency_key)
        except KeyError:
            raise IdempotencyItemNotFoundError(
                f"no claim of {idempotency_key!r} is held by this persistence layer") from None


def _lease(data_record: DataRecord, retention: timedelta) -> timedelta:
    """The claim's lease: until Powertools' in-progress expiry (the
    invocation's deadline) or the record's expiry, whichever comes first, as
    DynamoDB's conditional put decides; the whole retention without a deadline."""
    if data_record.in_progress_expiry_timestamp is None:
        return retention
    left = timedelta(milliseconds=data_record.in_progress_expiry_timestamp - time.time() * 1000)
    return min(max(left, MIN_LEASE), retention)


def _fingerprint(payload_hash: str) -> bytes:
    """The record's fingerprint: the validated payload's hash, as bytes."""
    if not payload_hash:
        return ANY_PAYLOAD
    digest = bytes.fromhex(payload_hash)
    return digest if len(digest) <= MAX_FINGERPRINT_BYTES else hashlib.sha256(digest).digest()


def _claimed_record(data_record: DataRecord, claim: Claim, retention: timedelta) -> DataRecord:
    """The record a claim found: completed (replay) or held by another
    invocation (in_progress, until the end of its lease)."""
    if claim.outcome == "replay":
        return DataRecord(idempotency_key=data_record.idempotency_key,
                          status=STATUS_CONSTANTS["COMPLETED"],
                          expiry_timestamp=math.ceil((claim.created_at + retention).timestamp()),
                          response_data=bytes(claim.body or b"").decode(),
                          payload_hash=data_record.payload_hash)
    return DataRecord(idempotency_key=data_record.idempotency_key,
                      status=STATUS_CONSTANTS["INPROGRESS"],
                      in_progress_expiry_timestamp=int((time.time() + claim.retry_after) * 1000),
                      payload_hash=data_record.payload_hash)


def _looked_up_record(record: Record) -> DataRecord:
    """A record as lookup shows it, in Powertools' terms."""
    completed = record.state == "completed"
    return DataRecord(
        idempotency_key=record.key,
        status=STATUS_CONSTANTS["COMPLETED" if completed else "INPROGRESS"],
        expiry_timestamp=int(record.expires_at.timestamp()),
        in_progress_expiry_timestamp=(None if completed
                                      else int(record.lease_expires_at.timestamp() * 1000)),
        response_data=bytes(record.body or b"").decode(),
        payload_hash="" if bytes(record.fingerprint) == ANY_PAYLOAD else bytes(record.fingerprint).hex())
