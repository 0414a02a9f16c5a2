"""PostgresPersistenceLayer under Powertools' own idempotency utility
(@idempotent, @idempotent_function), against the database: the scenarios
of Powertools' functional idempotency tests (tests/functional/idempotency
in aws-powertools/powertools-lambda-python), written anew for a real store
instead of their stubbed DynamoDB: first execution and replay, in progress
(with and without the local cache), payload validation (from the store and
from the cache), an expired record, an exception, the local cache, and a
Lambda timeout (the in-progress expiry) with the takeover that follows."""

import threading
from datetime import timedelta

import pytest
from aws_lambda_powertools.utilities.idempotency import (
    IdempotencyConfig,
    idempotent,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
    IdempotencyPersistenceLayerError,
    IdempotencyValidationError,
)

from helpers import value, wait_for
from pg_idempotency import ClaimLost
from pg_idempotency.powertools import PostgresPersistenceLayer

EVENT = {"body": '{"order": 42}', "requestContext": {"requestId": "r-1"}}


class LambdaContext:
    """What Powertools reads of a Lambda context; remaining: milliseconds left."""

    def __init__(self, remaining=30_000):
        """A context with this much time left."""
        self.function_name = "test-func"
        self.memory_limit_in_mb = 128
        self.invoked_function_arn = "arn:aws:lambda:eu-west-1:123456789012:function:test-func"
        self.aws_request_id = "52fdfc07-2182-154f-163f-5f0f9a621d72"
        self.remaining = remaining

    def get_remaining_time_in_millis(self) -> int:
        """The time the invocation has left."""
        return self.remaining


@pytest.fixture
def store(pool):
    """A persistence layer, as a Lambda function creates one at import."""
    return PostgresPersistenceLayer(pool)


def handler_on(store, calls, config=None, result=None, raises=None):
    """An @idempotent handler that records its calls and answers result."""
    config = config or IdempotencyConfig(event_key_jmespath="body")

    @idempotent(persistence_store=store, config=config)
    def handler(event, context):
        """Counts the call; raises when asked."""
        calls.append(event)
        if raises:
            raise raises
        return result if result is not None else {"statusCode": 201, "charge": len(calls)}
    return handler


def records(admin):
    """The records in the database: [(state, attempt)]."""
    return admin.execute("SELECT state, attempt FROM idempotency.keys ORDER BY created_at").fetchall()


def test_first_execution_runs_and_its_retry_replays_the_stored_result(store, admin):
    calls = []
    handler = handler_on(store, calls)
    first = handler(EVENT, LambdaContext())
    again = handler(EVENT, LambdaContext())
    assert first == again == {"statusCode": 201, "charge": 1}
    assert len(calls) == 1
    assert records(admin) == [("completed", 1)]
    assert value(admin, "SELECT convert_from(body, 'UTF8')::jsonb FROM idempotency.keys") == first


def test_an_event_key_selects_what_is_idempotent(store):
    calls = []
    handler = handler_on(store, calls, IdempotencyConfig(event_key_jmespath="powertools_json(body).order"))
    handler({"body": '{"order": 42, "at": 1}'}, LambdaContext())
    handler({"body": '{"order": 42, "at": 2}'}, LambdaContext())
    handler({"body": '{"order": 43, "at": 2}'}, LambdaContext())
    assert [c["body"] for c in calls] == ['{"order": 42, "at": 1}', '{"order": 43, "at": 2}']


@pytest.mark.parametrize("use_local_cache", [False, True])
def test_in_progress_is_powertools_in_progress_error_and_never_cached(store, pool, use_local_cache):
    config = IdempotencyConfig(event_key_jmespath="body", use_local_cache=use_local_cache)
    # Another invocation (another container: another layer) holds the key.
    other = PostgresPersistenceLayer(pool)
    other.configure(config, key_prefix="payments")
    other.save_inprogress(EVENT, remaining_time_in_millis=60_000)
    calls = []

    @idempotent(persistence_store=store, config=config, key_prefix="payments")
    def handler(event, context):
        """Must not run while the other invocation holds the key."""
        calls.append(event)
        return {"ok": True}
    for _ in range(3):
        with pytest.raises(IdempotencyAlreadyInProgressError):
            handler(EVENT, LambdaContext())
    assert calls == []
    if use_local_cache:
        assert len(store._cache) == 0


@pytest.mark.filterwarnings("ignore:Couldn't determine the remaining time left")
def test_of_concurrent_invocations_exactly_one_runs(store, admin):
    release = threading.Event()
    calls, answers = [], []

    @idempotent_function(persistence_store=store, data_keyword_argument="order",
                         config=IdempotencyConfig())
    def charge(order):
        """Holds the key until the others have been answered."""
        calls.append(order)
        release.wait(30)
        return {"charge": 1}

    def invoke():
        """One invocation; keeps its answer or its exception's class."""
        try:
            answers.append(charge(order={"id": 7}))
        except IdempotencyAlreadyInProgressError as err:
            answers.append(type(err))
    threads = [threading.Thread(target=invoke) for _ in range(4)]
    threads[0].start()
    wait_for(admin, "SELECT count(*) = 1 FROM idempotency.keys WHERE state = 'in_progress'")
    for thread in threads[1:]:
        thread.start()
        thread.join()
    release.set()
    threads[0].join()
    assert len(calls) == 1
    assert sorted(map(str, answers)) == sorted(
        [str({"charge": 1})] + [str(IdempotencyAlreadyInProgressError)] * 3)


VALIDATED = IdempotencyConfig(event_key_jmespath="body", payload_validation_jmespath="requestContext")
TAMPERED = {**EVENT, "requestContext": {"requestId": "r-2"}}


def test_payload_validation_refuses_another_payload_for_a_completed_key(store, admin):
    calls = []
    handler = handler_on(store, calls, VALIDATED)
    handler(EVENT, LambdaContext())
    with pytest.raises(IdempotencyValidationError):
        handler(TAMPERED, LambdaContext())
    assert len(calls) == 1
    assert handler(EVENT, LambdaContext()) == {"statusCode": 201, "charge": 1}
    # The validated part's hash is the record's fingerprint.
    assert len(value(admin, "SELECT fingerprint FROM idempotency.keys")) == 16   # md5


def test_payload_validation_refuses_another_payload_while_in_progress(store, pool):
    other = PostgresPersistenceLayer(pool)
    other.configure(VALIDATED, key_prefix="payments")
    other.save_inprogress(EVENT, remaining_time_in_millis=60_000)

    @idempotent(persistence_store=store, config=VALIDATED, key_prefix="payments")
    def handler(event, context):
        """Must not run."""
        raise AssertionError("ran")
    with pytest.raises(IdempotencyValidationError):
        handler(TAMPERED, LambdaContext())
    with pytest.raises(IdempotencyAlreadyInProgressError):
        handler(EVENT, LambdaContext())


def test_payload_validation_from_the_local_cache(store, admin):
    calls = []
    config = IdempotencyConfig(event_key_jmespath="body", payload_validation_jmespath="requestContext",
                               use_local_cache=True, hash_function="sha256")
    handler = handler_on(store, calls, config)
    handler(EVENT, LambdaContext())
    admin.execute("DELETE FROM idempotency.keys")   # only the cache knows the record now
    with pytest.raises(IdempotencyValidationError):
        handler(TAMPERED, LambdaContext())
    assert len(calls) == 1


@pytest.mark.parametrize("use_local_cache", [False, True])
def test_the_local_cache_answers_without_the_database(store, admin, use_local_cache):
    calls = []
    handler = handler_on(store, calls, IdempotencyConfig(event_key_jmespath="body",
                                                         use_local_cache=use_local_cache))
    handler(EVENT, LambdaContext())
    admin.execute("DELETE FROM idempotency.keys")
    handler(EVENT, LambdaContext())
    # From the cache the function does not run again; without it, the
    # deleted record is a new key and it does.
    assert len(calls) == (1 if use_local_cache else 2)


def test_a_record_runs_again_once_it_expired(store, admin):
    calls = []
    handler = handler_on(store, calls, IdempotencyConfig(event_key_jmespath="body", expires_after_seconds=1))
    handler(EVENT, LambdaContext(remaining=500))
    assert value(admin, "SELECT expires_at - created_at FROM idempotency.keys").total_seconds() == 1
    wait_for(admin, "SELECT NOT EXISTS (SELECT FROM idempotency.keys WHERE expires_at > clock_timestamp())")
    assert handler(EVENT, LambdaContext()) == {"statusCode": 201, "charge": 2}
    assert records(admin) == [("completed", 1)], "the expired record counts as absent: attempt 1"


def age(admin, seconds):
    """Moves every record's clock readings back by seconds, as if that much
    time had passed since its claim (no sleep that assumes timing)."""
    admin.execute("""UPDATE idempotency.keys SET created_at = created_at - %(age)s,
                         expires_at = expires_at - %(age)s,
                         completed_at = completed_at - %(age)s,
                         lease_expires_at = lease_expires_at - %(age)s""",
                  {"age": timedelta(seconds=seconds)})


def test_a_completed_record_expires_after_its_expiry_whatever_time_the_lambda_had_left(store, admin):
    # Powertools' DynamoDB layer: a record past expires_after_seconds is
    # absent, however long the invocation that wrote it had left.
    calls = []
    handler = handler_on(store, calls, IdempotencyConfig(event_key_jmespath="body", expires_after_seconds=2))
    handler(EVENT, LambdaContext(remaining=10_000))
    age(admin, 3)
    assert handler(EVENT, LambdaContext(remaining=10_000)) == {"statusCode": 201, "charge": 2}
    assert records(admin) == [("completed", 1)]


def test_an_in_progress_record_past_its_expiry_runs_again_as_dynamodb_overwrites_it(pool, store, admin):
    # DynamoDB's conditional put succeeds once the expiry has passed, even
    # while the in-progress expiry (the Lambda's remaining time) has not.
    config = IdempotencyConfig(event_key_jmespath="body", expires_after_seconds=2)
    first = PostgresPersistenceLayer(pool)
    first.configure(config, key_prefix="payments")
    first.save_inprogress(EVENT, remaining_time_in_millis=10_000)
    age(admin, 3)
    calls = []

    @idempotent(persistence_store=store, config=config, key_prefix="payments")
    def handler(event, context):
        """The next invocation."""
        calls.append(event)
        return {"charge": len(calls)}
    assert handler(EVENT, LambdaContext(remaining=10_000)) == {"charge": 1}
    assert records(admin) == [("completed", 1)], "past its expiry and its lease: absent"
    with pytest.raises(ClaimLost):
        first.save_success(EVENT, {"charge": "stale"})


def test_a_record_replayed_within_its_expiry_reports_that_expiry(store, admin):
    calls = []
    handler = handler_on(store, calls, IdempotencyConfig(event_key_jmespath="body", expires_after_seconds=5))
    handler(EVENT, LambdaContext(remaining=10_000))
    age(admin, 3)
    assert handler(EVENT, LambdaContext(remaining=10_000)) == {"statusCode": 201, "charge": 1}
    assert value(admin, "SELECT expires_at - created_at FROM idempotency.keys").total_seconds() == 5


def test_an_exception_releases_the_key_and_the_retry_runs(store, admin):
    calls = []
    failing = handler_on(store, calls, raises=RuntimeError("card declined"))
    with pytest.raises(RuntimeError, match="card declined"):
        failing(EVENT, LambdaContext())
    assert records(admin) == []
    assert handler_on(store, calls)(EVENT, LambdaContext()) == {"statusCode": 201, "charge": 2}


def test_the_in_progress_expiry_is_the_lambdas_remaining_time(store, admin):
    config = IdempotencyConfig(event_key_jmespath="body")
    config.register_lambda_context(LambdaContext(remaining=45_000))
    store.configure(config, key_prefix="payments")
    store.save_inprogress(EVENT, remaining_time_in_millis=45_000)
    lease = value(admin, "SELECT lease FROM idempotency.keys").total_seconds()
    assert 44 <= lease <= 45


def test_without_a_lambda_context_the_key_is_held_for_the_record_expiry(store, admin):
    store.configure(IdempotencyConfig(event_key_jmespath="body", expires_after_seconds=600))
    with pytest.warns(UserWarning, match="remaining time"):
        store.save_inprogress(EVENT)
    assert value(admin, "SELECT lease FROM idempotency.keys").total_seconds() == 600


def test_a_lambda_timeout_lets_the_next_invocation_take_over_and_fences_the_first(pool, admin):
    config = IdempotencyConfig(event_key_jmespath="body")
    # The first invocation claims with 1 second left and then times out:
    # Lambda freezes it before save_success.
    timed_out = PostgresPersistenceLayer(pool)
    timed_out.configure(config, key_prefix="payments")
    timed_out.save_inprogress(EVENT, remaining_time_in_millis=1000)
    calls = []
    retry = PostgresPersistenceLayer(pool)

    @idempotent(persistence_store=retry, config=config, key_prefix="payments")
    def handler(event, context):
        """The retried invocation."""
        calls.append(event)
        return {"charge": len(calls)}
    with pytest.raises(IdempotencyAlreadyInProgressError):
        handler(EVENT, LambdaContext())
    wait_for(admin, "SELECT bool_and(lease_expires_at < clock_timestamp()) FROM idempotency.keys")
    assert handler(EVENT, LambdaContext()) == {"charge": 1}
    assert records(admin) == [("completed", 2)], "a takeover: attempt 2"
    # The frozen invocation wakes up: its fence lost, it cannot overwrite.
    with pytest.raises(ClaimLost):
        timed_out.save_success(EVENT, {"charge": "stale"})
    assert handler(EVENT, LambdaContext()) == {"charge": 1}


def test_a_lost_claim_is_powertools_persistence_error(pool, admin):
    store = PostgresPersistenceLayer(pool)

    @idempotent(persistence_store=store, config=IdempotencyConfig(event_key_jmespath="body"))
    def handler(event, context):
        """Its claim is taken from it while it runs."""
        admin.execute("DELETE FROM idempotency.keys")
        return {"charge": 1}
    with pytest.raises(IdempotencyPersistenceLayerError) as err:
        handler(EVENT, LambdaContext())
    assert isinstance(err.value.__cause__, ClaimLost)


def test_records_are_scoped(pool, admin):
    calls = []
    tenant_a = handler_on(PostgresPersistenceLayer(pool, scope="tenant-a"), calls)
    tenant_b = handler_on(PostgresPersistenceLayer(pool, scope="tenant-b"), calls)
    tenant_a(EVENT, LambdaContext())
    tenant_b(EVENT, LambdaContext())
    assert len(calls) == 2
    assert value(admin, "SELECT array_agg(scope ORDER BY scope)::text FROM idempotency.keys") == "{tenant-a,tenant-b}"


def test_get_record_reads_the_record_as_powertools_sees_it(store):
    calls = []
    handler_on(store, calls, VALIDATED)(EVENT, LambdaContext())
    record = store.get_record(EVENT)
    assert record.status == "COMPLETED"
    assert record.response_json_as_dict() == {"statusCode": 201, "charge": 1}
    assert record.payload_hash == store._get_hashed_payload(EVENT)


def test_in_one_process_a_timed_out_invocation_cannot_complete_with_its_successors_fence(store, admin):
    config = IdempotencyConfig(event_key_jmespath="body")
    store.configure(config, key_prefix="payments")

    def in_thread(call):
        """Runs call in a thread of its own (an invocation); returns what it raised."""
        raised = []

        def run():
            """Keeps the exception."""
            try:
                call()
            except Exception as err:  # noqa: BLE001 - the test looks at it
                raised.append(err)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return raised
    assert in_thread(lambda: store.save_inprogress(EVENT, remaining_time_in_millis=1000)) == []
    wait_for(admin, "SELECT bool_and(lease_expires_at < clock_timestamp()) FROM idempotency.keys")
    successor = threading.Event()
    done = threading.Event()

    def take_over_and_wait():
        """The invocation that takes the key over; completes when told."""
        store.save_inprogress(EVENT, remaining_time_in_millis=60_000)
        successor.set()
        done.wait(30)
        store.save_success(EVENT, {"charge": "successor"})
    thread = threading.Thread(target=take_over_and_wait)
    thread.start()
    successor.wait(30)
    # The first invocation's thread is gone; one more in the same process
    # that holds no claim of the key must not complete with the successor's.
    raised = in_thread(lambda: store.save_success(EVENT, {"charge": "stale"}))
    done.set()
    thread.join()
    assert len(raised) == 1
    assert value(admin, "SELECT convert_from(body, 'UTF8') FROM idempotency.keys") == '{"charge": "successor"}'
