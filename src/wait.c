/*-------------------------------------------------------------------------
 * wait.c
 *	  Claims waiting for an owner to finish: shared condition variables,
 *	  broadcast when a complete or release commits.
 *
 * A claim with `wait` that meets a live lease sleeps on the condition
 * variable of its key's slot.  complete() and release() queue a broadcast
 * of that slot for when their transaction commits (or is prepared: a
 * waiter then finds the prepared transaction writing the record and waits
 * for it to end, at COMMIT PREPARED).  Without preloading
 * there is no shared memory: a waiting claim then re-checks at least once
 * a second.
 *
 * A claim also waits for the transaction that is writing the record it
 * met (an uncommitted claim, complete or release), as a write would,
 * with a bound when it has one (its `wait`).
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "common/hashfn.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/proc.h"
#include "storage/condition_variable.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/resowner.h"
#include "utils/typcache.h"

#include "catalog.h"
#include "compat.h"
#include "wait.h"

/* Keys hash onto this many condition variables; a collision only wakes a waiter early. */
#define WAIT_SLOTS 128

typedef struct IdemWaitSlots
{
	ConditionVariable cv[WAIT_SLOTS];
} IdemWaitSlots;

static IdemWaitSlots *slots = NULL;

/* Slots to broadcast when the current transaction commits. */
static uint32 pending_wakes[8];
static int	n_pending_wakes = 0;
static bool wake_all_at_commit = false;
static bool xact_callback_registered = false;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Asks for the shared memory of the condition variables. */
static void
wait_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(IdemWaitSlots)));
}

/* Creates or attaches to the condition variables. */
static void
wait_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	slots = ShmemInitStruct("idempotency wait slots", sizeof(IdemWaitSlots), &found);
	if (!found)
		for (int i = 0; i < WAIT_SLOTS; i++)
			ConditionVariableInit(&slots->cv[i]);
	LWLockRelease(AddinShmemInitLock);
}

/* Installs the shared memory hooks; called from _PG_init. */
void
idem_wait_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = wait_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = wait_shmem_startup;
}

/* Returns the slot where claims of keyhash sleep. */
static ConditionVariable *
slot_of(uint64 keyhash)
{
	return &slots->cv[keyhash % WAIT_SLOTS];
}

/*
 * Broadcasts the slots queued by this transaction once it has committed or
 * been prepared, and forgets them when it ends.
 */
static void
wake_at_commit_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			if (wake_all_at_commit)
				for (int i = 0; i < WAIT_SLOTS; i++)
					ConditionVariableBroadcast(&slots->cv[i]);
			else
				for (int i = 0; i < n_pending_wakes; i++)
					ConditionVariableBroadcast(&slots->cv[pending_wakes[i]]);
			pg_fallthrough;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			n_pending_wakes = 0;
			wake_all_at_commit = false;
			break;
		default:
			break;
	}
}

/* Queues a wake-up of the claims waiting on keyhash, for when this transaction commits. */
void
idem_wait_wake_at_commit(uint64 keyhash)
{
	uint32		slot = keyhash % WAIT_SLOTS;

	if (!slots)
		return;
	if (!xact_callback_registered)
	{
		RegisterXactCallback(wake_at_commit_callback, NULL);
		xact_callback_registered = true;
	}
	for (int i = 0; i < n_pending_wakes; i++)
		if (pending_wakes[i] == slot)
			return;
	if (n_pending_wakes < (int) lengthof(pending_wakes))
		pending_wakes[n_pending_wakes++] = slot;
	else
		wake_all_at_commit = true;	/* a transaction that ends many claims */
}

/* Registers interest in keyhash before the caller checks the record again. */
void
idem_wait_prepare(uint64 keyhash)
{
	if (slots)
		ConditionVariablePrepareToSleep(slot_of(keyhash));
}

/*
 * Sleeps until the slot of keyhash is broadcast or timeout_ms passes;
 * without shared memory, a plain latch wait.
 */
void
idem_wait_sleep(uint64 keyhash, long timeout_ms)
{
	if (slots)
	{
		(void) ConditionVariableTimedSleep(slot_of(keyhash), timeout_ms, PG_WAIT_EXTENSION);
		return;
	}
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 timeout_ms, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/* Ends a sleep prepared with idem_wait_prepare. */
void
idem_wait_cancel(void)
{
	if (slots)
		ConditionVariableCancelSleep();
}

/*
 * Hashes (scope, key), scope a value of type: where claims waiting for its
 * owner sleep.  A text scope is its bytes; a Citus tenant's value of another
 * type (bigint, uuid) is hashed as that value, since texts that differ
 * ('007' and '7', a uuid in upper and lower case) name the same record.
 */
uint64
idem_key_hash(const IdemScopeType *type, Datum scope, text *key)
{
	uint64		h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
										VARSIZE_ANY_EXHDR(key), 0);
	uint64		scope_hash;

	if (type->is_text)
		scope_hash = hash_bytes_extended((const unsigned char *) VARDATA_ANY(DatumGetPointer(scope)),
										 VARSIZE_ANY_EXHDR(DatumGetPointer(scope)), 0);
	else
	{
		TypeCacheEntry *tc = lookup_type_cache(type->type, TYPECACHE_HASH_EXTENDED_PROC_FINFO);

		if (!OidIsValid(tc->hash_extended_proc))
			elog(ERROR, "type %s has no extended hash function", format_type_be(type->type));
		scope_hash = DatumGetUInt64(FunctionCall2Coll(&tc->hash_extended_proc_finfo,
													  type->collation, scope,
													  UInt64GetDatum(0)));
	}
	return hash_combine64(h, scope_hash);
}

/*
 * Waits for transaction xid to end, at most timeout_ms (< 0: without bound
 * but lock_timeout).  The bounded wait runs in a subtransaction in which
 * lock_timeout is at most timeout_ms, so that the timeout can be caught; an
 * error other than that timeout (a cancel, a deadlock, the caller's shorter
 * lock_timeout) is raised again.  Returns whether xid has ended.
 */
bool
idem_wait_for_xact(TransactionId xid, long timeout_ms)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	int			saved_lock_timeout = LockTimeout;
	bool		ours = (LockTimeout <= 0 || LockTimeout > timeout_ms);
	volatile bool ended = false;

	if (timeout_ms < 0)
	{
		XactLockTableWait(xid, NULL, NULL, XLTW_None);
		return true;
	}
	if (ConditionalXactLockTableWait(xid))
		return true;
	if (timeout_ms == 0)
		return false;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		if (ours)
			LockTimeout = (int) Min(timeout_ms, INT_MAX);
		XactLockTableWait(xid, NULL, NULL, XLTW_None);
		LockTimeout = saved_lock_timeout;
		ReleaseCurrentSubTransaction();
		ended = true;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		LockTimeout = saved_lock_timeout;
		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
		if (!ours || edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			ReThrowError(edata);
		FreeErrorData(edata);
	}
	PG_END_TRY();
	MemoryContextSwitchTo(cxt);
	CurrentResourceOwner = owner;
	return ended;
}
