/*-------------------------------------------------------------------------
 * stats.c
 *	  Shared memory of the idempotency extension: the counters of the
 *	  idempotency.stats view and the condition variables that wake claims
 *	  waiting for an owner to finish.
 *
 * Everything here exists only when the library is preloaded; without it the
 * counters read as NULL and waiting claims re-check once a second instead.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/condition_variable.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "idempotency.h"

/* Claims hash onto this many condition variables; a collision only wakes a waiter early. */
#define WAIT_SLOTS 128

typedef struct IdemShared
{
	pg_atomic_uint64 counters[IDEM_NUM_COUNTERS];
	pg_atomic_uint64 last_reap_at;	/* TimestampTz, 0 when never */
	pg_atomic_uint64 stats_reset_at;	/* TimestampTz */
	slock_t		error_lock;		/* protects last_reap_error */
	char		last_reap_error[256];	/* "" when the last run succeeded */
	ConditionVariable wait_cv[WAIT_SLOTS];
} IdemShared;

static IdemShared *shared = NULL;

/* Slots to broadcast when the current transaction commits. */
static uint32 pending_wakes[8];
static int	n_pending_wakes = 0;
static bool wake_all_at_commit = false;
static bool xact_callback_registered = false;

PG_FUNCTION_INFO_V1(idempotency_stats_counters);
PG_FUNCTION_INFO_V1(idempotency_stats_reset);

/* Asks for the shared memory this file needs. */
void
stats_shmem_request(void)
{
	RequestAddinShmemSpace(MAXALIGN(sizeof(IdemShared)));
}

/* Attaches to (or creates) the shared memory at postmaster or backend start. */
void
stats_shmem_startup(void)
{
	bool		found;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	shared = ShmemInitStruct("idempotency", sizeof(IdemShared), &found);
	if (!found)
	{
		for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
			pg_atomic_init_u64(&shared->counters[i], 0);
		pg_atomic_init_u64(&shared->last_reap_at, 0);
		pg_atomic_init_u64(&shared->stats_reset_at, (uint64) GetCurrentTimestamp());
		SpinLockInit(&shared->error_lock);
		shared->last_reap_error[0] = '\0';
		for (int i = 0; i < WAIT_SLOTS; i++)
			ConditionVariableInit(&shared->wait_cv[i]);
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Tells whether shared memory exists, i.e. the library was preloaded. */
bool
stats_available(void)
{
	return shared != NULL;
}

/* Adds n to a counter; a no-op without preloading. */
void
stats_add(IdemCounter counter, uint64 n)
{
	if (shared)
		pg_atomic_fetch_add_u64(&shared->counters[counter], n);
}

/* Records when the reaper (or reap()) last ran. */
void
stats_set_last_reap(TimestampTz at)
{
	if (shared)
		pg_atomic_write_u64(&shared->last_reap_at, (uint64) at);
}

/* Records the message of the reaper's last failure, or "" after a success. */
void
stats_set_reap_error(const char *message)
{
	if (!shared)
		return;
	SpinLockAcquire(&shared->error_lock);
	strlcpy(shared->last_reap_error, message, sizeof(shared->last_reap_error));
	SpinLockRelease(&shared->error_lock);
}

/* Returns the counters as one row, all NULL without preloading. */
Datum
idempotency_stats_counters(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[IDEM_NUM_COUNTERS + 3];
	bool		nulls[IDEM_NUM_COUNTERS + 3];
	char		error[sizeof(shared->last_reap_error)];
	uint64		ts;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	if (tupdesc->natts != lengthof(values))
		elog(ERROR, "stats function returns %d columns, expected %d",
			 tupdesc->natts, (int) lengthof(values));

	memset(nulls, !shared, sizeof(nulls));
	if (shared)
	{
		for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
			values[i] = Int64GetDatum((int64) pg_atomic_read_u64(&shared->counters[i]));
		ts = pg_atomic_read_u64(&shared->last_reap_at);
		values[IDEM_NUM_COUNTERS] = TimestampTzGetDatum((TimestampTz) ts);
		nulls[IDEM_NUM_COUNTERS] = (ts == 0);
		values[IDEM_NUM_COUNTERS + 1] =
			TimestampTzGetDatum((TimestampTz) pg_atomic_read_u64(&shared->stats_reset_at));
		SpinLockAcquire(&shared->error_lock);
		strlcpy(error, shared->last_reap_error, sizeof(error));
		SpinLockRelease(&shared->error_lock);
		values[IDEM_NUM_COUNTERS + 2] = CStringGetTextDatum(error);
		nulls[IDEM_NUM_COUNTERS + 2] = (error[0] == '\0');
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

/* Zeroes the counters and notes when. */
Datum
idempotency_stats_reset(PG_FUNCTION_ARGS)
{
	if (!shared)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency statistics are not available"),
				 errhint("Add idempotency to shared_preload_libraries and restart the server.")));
	for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
		pg_atomic_write_u64(&shared->counters[i], 0);
	pg_atomic_write_u64(&shared->last_reap_at, 0);
	stats_set_reap_error("");
	pg_atomic_write_u64(&shared->stats_reset_at, (uint64) GetCurrentTimestamp());
	PG_RETURN_VOID();
}

/* Broadcasts the slots queued by this transaction once it has committed. */
static void
wake_at_commit_callback(XactEvent event, void *arg)
{
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT)
	{
		if (wake_all_at_commit)
			for (int i = 0; i < WAIT_SLOTS; i++)
				ConditionVariableBroadcast(&shared->wait_cv[i]);
		else
			for (int i = 0; i < n_pending_wakes; i++)
				ConditionVariableBroadcast(&shared->wait_cv[pending_wakes[i]]);
	}
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
	{
		n_pending_wakes = 0;
		wake_all_at_commit = false;
	}
}

/* Queues a wake-up of the claims waiting on keyhash, for when this transaction commits. */
void
wait_wake_at_commit(uint32 keyhash)
{
	uint32		slot = keyhash % WAIT_SLOTS;

	if (!shared)
		return;
	if (!xact_callback_registered)
	{
		RegisterXactCallback(wake_at_commit_callback, NULL);
		xact_callback_registered = true;
	}
	for (int i = 0; i < n_pending_wakes; i++)
		if (pending_wakes[i] == slot)
			return;
	if (n_pending_wakes < lengthof(pending_wakes))
		pending_wakes[n_pending_wakes++] = slot;
	else
		wake_all_at_commit = true;	/* a transaction that ends many claims */
}

/* Registers interest in keyhash before the caller checks the record again. */
void
wait_prepare(uint32 keyhash)
{
	if (shared)
		ConditionVariablePrepareToSleep(&shared->wait_cv[keyhash % WAIT_SLOTS]);
}

/*
 * Sleeps until the slot of keyhash is broadcast or timeout_ms passes.
 * Without shared memory it is a plain latch wait.  Returns true on timeout.
 */
bool
wait_sleep(uint32 keyhash, long timeout_ms)
{
	if (shared)
		return ConditionVariableTimedSleep(&shared->wait_cv[keyhash % WAIT_SLOTS],
										   timeout_ms, PG_WAIT_EXTENSION);

	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 timeout_ms, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
	return true;
}

/* Ends a sleep prepared with wait_prepare. */
void
wait_cancel(void)
{
	if (shared)
		ConditionVariableCancelSleep();
}
