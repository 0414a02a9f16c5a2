/*-------------------------------------------------------------------------
 * fence.c
 *	  Fences: the fencing tokens claims hand out, drawn from
 *	  idempotency.fence_seq, and made durable before anyone sees them.
 *
 * A fence is never handed out twice: each is drawn under a lock that keeps
 * a raised sequence (Citus, after a shard move) from moving back below a
 * fence another backend drew, and the claim that drew it flushes the
 * sequence's WAL before it answers.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/relation.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "commands/sequence.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "utils/fmgrprotos.h"
#include "utils/lsyscache.h"

#include "catalog.h"
#include "compat.h"
#include "fence.h"

/* The fence lock's tranche, and whether it was asked for (the library was preloaded). */
#define FENCE_TRANCHE "idempotency fence"
static bool fence_lock_requested = false;

static shmem_request_hook_type prev_shmem_request_hook = NULL;

PG_FUNCTION_INFO_V1(idempotency_fence_at_least);

/* Asks for the fence lock. */
static void
fence_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestNamedLWLockTranche(FENCE_TRANCHE, 1);
}

/* Asks for the fence lock in shared memory, when preloading; called from _PG_init. */
void
idem_fence_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = fence_shmem_request;
	fence_lock_requested = true;
}

/* The lock under which fences are drawn; NULL without preloading. */
static LWLock *
fence_lock(void)
{
	static LWLock *lock = NULL;

	if (lock == NULL && fence_lock_requested)
		lock = &GetNamedLWLockTranche(FENCE_TRANCHE)->lock;
	return lock;
}

/*
 * Returns a new fence of at least at_least from sequence seq: its next value,
 * or at_least, with the sequence raised to it, when the sequence is behind.
 * It is behind only with Citus, for records that came with a shard move
 * (their fence + 1) and for the floor after shards arrive (citus.c).
 *
 * A draw that may raise the sequence holds the fence lock exclusively, the
 * others share it: setval must not move the sequence back below a value that
 * another backend drew between this nextval and this setval.  The sequence's
 * own lock is taken first, so that nothing waits for it while holding ours.
 * idem_keys_flush_fence covers a setval as it covers nextval: it flushes the
 * sequence page's LSN.
 */
static int64
next_fence(Oid seq, int64 at_least)
{
	LWLock	   *lock = fence_lock();
	int64		fence;

	if (lock)
	{
		LockRelationOid(seq, RowExclusiveLock);
		LWLockAcquire(lock, at_least > 0 ? LW_EXCLUSIVE : LW_SHARED);
	}
	fence = nextval_internal(seq, false);
	if (fence < at_least)
	{
		DirectFunctionCall2(setval_oid, ObjectIdGetDatum(seq), Int64GetDatum(at_least));
		fence = at_least;
	}
	if (lock)
		LWLockRelease(lock);
	return fence;
}

/* Returns a new fence of at least at_least (see next_fence). */
int64
idem_keys_next_fence(int64 at_least)
{
	return next_fence(idem_keys_catalog()->fence_seq_relid, at_least);
}

/*
 * _fence_at_least(at_least): draws a fence of at least at_least, raising the
 * fence sequence when it is behind; citus_distribute raises every node's
 * sequence with it.  It does not touch idempotency.keys, which the caller
 * may have locked (citus_distribute, through a connection to this node).
 */
Datum
idempotency_fence_at_least(PG_FUNCTION_ARGS)
{
	Oid			seq = get_relname_relid("fence_seq", get_namespace_oid("idempotency", false));

	PG_RETURN_INT64(next_fence(seq, PG_GETARG_INT64(0)));
}

/*
 * Waits until the synchronous standbys have the WAL up to lsn, when
 * synchronous replication is in force, as a commit waits for its record.
 * Only a claim that drew a new batch of the fence sequence gets here with an
 * lsn not yet confirmed: one wait per 32 fences.  Cancel and statement_timeout
 * end the wait (SyncRepWaitForLSN warns) and then fail the claim, since its
 * fence may be unknown to a standby that is promoted; terminate ends the
 * backend.  Without synchronous standbys configured it returns at once.
 * (Should they have just been removed, a claim waiting meanwhile is
 * released unconfirmed and fails once; its retry does not wait.)
 */
static void
wait_for_sync_standbys(XLogRecPtr lsn)
{
	static XLogRecPtr confirmed = InvalidXLogRecPtr;
	int			mode;
	bool		reached;

	/*
	 * This backend's synchronous_standby_names, as of its last reload, tells
	 * whether there is anything to wait for: no SyncRepLock is taken then.
	 */
	if (lsn <= confirmed || !SyncRepRequested() ||
		SyncRepStandbyNames == NULL || SyncRepStandbyNames[0] == '\0')
		return;

	/* SyncRepWaitForLSN handles interrupts itself, as during a commit. */
	HOLD_INTERRUPTS();
	SyncRepWaitForLSN(lsn, false);
	RESUME_INTERRUPTS();
	CHECK_FOR_INTERRUPTS();

	/* A wait that is not capped to remote_write waits for remote_flush. */
	mode = synchronous_commit == SYNCHRONOUS_COMMIT_REMOTE_WRITE ?
		SYNC_REP_WAIT_WRITE : SYNC_REP_WAIT_FLUSH;
	LWLockAcquire(SyncRepLock, LW_SHARED);
	reached = lsn <= WalSndCtl->lsn[mode];
	LWLockRelease(SyncRepLock);
	if (reached)
		confirmed = lsn;
	else
		ereport(ERROR,
				(errcode(ERRCODE_QUERY_CANCELED),
				 errmsg("canceling claim before its fence reached the synchronous standby"),
				 errdetail("A fence is handed out only once the synchronous standbys have it, so that a promoted standby cannot hand it out again.")));
}

/*
 * Makes the fence just handed out durable before anyone sees it.
 *
 * A sequence is WAL-logged once per 32 values, and that record is flushed
 * only by some later commit, and with synchronous_commit off by none before
 * the WAL writer comes round.  Should the server crash before then, the
 * sequence would restart below a fence already given to a client whose claim
 * never committed (or whose asynchronous commit was lost), and hand that
 * fence out again: the old client's complete would then succeed on the new
 * owner's claim.  So the claim flushes, whatever synchronous_commit says.
 * The same holds for a synchronous standby that is promoted without that
 * record, so the claim also waits for the synchronous standbys to have it,
 * where synchronous_commit asks commits to wait for them.  Flushing up to
 * the sequence page's LSN costs nothing when that record is already on disk
 * (31 claims in 32), and one WAL flush otherwise.  Call it after
 * idem_call_end.
 */
void
idem_keys_flush_fence(void)
{
	Relation	seqrel = relation_open(idem_keys_catalog()->fence_seq_relid, AccessShareLock);
	Buffer		buf = ReadBuffer(seqrel, 0);
	XLogRecPtr	lsn;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	lsn = PageGetLSN(BufferGetPage(buf));
	UnlockReleaseBuffer(buf);
	relation_close(seqrel, AccessShareLock);
	XLogFlush(lsn);
	wait_for_sync_standbys(lsn);
}
