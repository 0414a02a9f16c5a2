/*-------------------------------------------------------------------------
 * fence.c
 *	  Fences: the fencing tokens claims hand out, drawn from
 *	  idempotency.fence_seq, and made durable before anyone sees them.
 *
 * A fence is never handed out twice: after a crash, a restore from pg_dump
 * (which dumps the sequence) or the promotion of a synchronous standby,
 * every fence handed out is at most the sequence's durable value, so the
 * sequence goes on above it.
 *
 * Preloaded, fences come from a block per database in shared memory, so
 * that one durable write of the sequence covers FENCE_BLOCK claims.  A
 * block is drawn by advancing the sequence past it (nextval, then setval to
 * the block's last fence: a WAL record of that exact value), and a fence
 * of the block is handed out only once that record is flushed, and has
 * reached the synchronous standbys where synchronous replication is in force.  The
 * locking protocol:
 *
 * - A draw from a block first takes the sequence's heavyweight lock
 *   (RowExclusiveLock, held to the end of the transaction, as nextval does),
 *   so that nothing waits for a heavyweight lock while holding ours, then
 *   the "idempotency fence" LWLock exclusively.  Under it, it reads the
 *   sequence's page (shared buffer lock) and takes the next fence of the
 *   block only if the block is this database's, of this sequence (by OID),
 *   and the page is as the block's draw left it: the same page LSN and
 *   last_value.  Anything else wrote to the sequence since, and the block
 *   is dropped: DROP and CREATE EXTENSION (a new sequence, whose page never
 *   carries the old one's LSN), a DBA's setval, nextval or ALTER SEQUENCE,
 *   whose value then holds from the next claim on, as without blocks.
 * - A new block is drawn under the same LWLock, and the block's LSN is
 *   set before it is released.  The flush and the wait for the
 *   synchronous standbys happen after it is released, by every backend
 *   that takes a fence of the block (at once when the WAL is already
 *   there), so no backend waits for the WAL or a standby while holding the
 *   LWLock, and none hands out a fence that is not yet durable.
 * - This file takes the sequence's buffer lock only while it holds the
 *   LWLock, never the other way round, and nextval and setval take no
 *   LWLock of ours: no deadlock between the two.
 *
 * A fence of the block is at least the at_least asked for (a takeover's old
 * fence + 1; Citus's floors): a block that does not reach it is replaced by
 * one that starts there, raising the sequence.  Within a block fences
 * increase in the order they are handed out, and every block starts above
 * the sequence's value when drawn, so fences are unique and increase on
 * every claim and takeover of a key, unless a DBA moves the sequence back
 * (as without blocks).  A crash, restart or promotion empties shared memory:
 * the rest of a block is skipped, never handed out.  More databases than
 * FENCE_SLOTS take the slots of the ones that drew least recently.
 *
 * Without preloading there is no shared memory: each fence is the
 * sequence's nextval, and the claim flushes the sequence page's LSN (one
 * flush per 32 fences, the sequence's own WAL-ahead).
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/relation.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_sequence.h"
#include "commands/sequence.h"
#include "common/int.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/fmgrprotos.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/syscache.h"

#include "catalog.h"
#include "compat.h"
#include "fence.h"

/* The fence lock's tranche. */
#define FENCE_TRANCHE "idempotency fence"

/* Fences one durable write of the sequence covers. */
#define FENCE_BLOCK 4096

/* Databases whose blocks shared memory holds at once. */
#define FENCE_SLOTS 64

/* A database's block of fences: next..limit are still to be handed out. */
typedef struct FenceBlock
{
	Oid			dboid;			/* InvalidOid: a free slot */
	Oid			seq;			/* the sequence it was drawn from */
	XLogRecPtr	lsn;			/* the sequence page's LSN after the draw */
	int64		next;
	int64		limit;			/* the sequence's last_value after the draw */
	uint64		drawn_at;		/* the draw's number: the oldest slot is reused */
} FenceBlock;

typedef struct FenceShared
{
	uint64		draws;
	FenceBlock	blocks[FENCE_SLOTS];
} FenceShared;

/* The sequence's page as read: its LSN and its value. */
typedef struct SeqPage
{
	XLogRecPtr	lsn;
	int64		last_value;
} SeqPage;

static FenceShared *fence_shared = NULL;

/* The WAL the fence drawn last in this backend needs flushed. */
static XLogRecPtr fence_lsn = InvalidXLogRecPtr;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

PG_FUNCTION_INFO_V1(idempotency_fence_at_least);

/* Asks for the fence lock and the blocks. */
static void
fence_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestNamedLWLockTranche(FENCE_TRANCHE, 1);
	RequestAddinShmemSpace(MAXALIGN(sizeof(FenceShared)));
}

/* Creates or attaches to the blocks at postmaster or backend start. */
static void
fence_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	fence_shared = ShmemInitStruct("idempotency fence blocks", sizeof(FenceShared), &found);
	if (!found)
		memset(fence_shared, 0, sizeof(FenceShared));
	LWLockRelease(AddinShmemInitLock);
}

/* Installs the shared memory hooks, when preloading; called from _PG_init. */
void
idem_fence_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = fence_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = fence_shmem_startup;
}

/* The lock under which blocks are drawn and taken from. */
static LWLock *
fence_lock(void)
{
	static LWLock *lock = NULL;

	if (lock == NULL)
		lock = &GetNamedLWLockTranche(FENCE_TRANCHE)->lock;
	return lock;
}

/* Reads the LSN and last_value of sequence seqrel's page. */
static SeqPage
read_seq_page(Relation seqrel)
{
	Buffer		buf = ReadBuffer(seqrel, 0);
	Page		page;
	HeapTupleHeader tup;
	SeqPage		result;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	page = BufferGetPage(buf);
	tup = (HeapTupleHeader) PageGetItem(page, PageGetItemId(page, FirstOffsetNumber));
	result.lsn = PageGetLSN(page);
	result.last_value = ((Form_pg_sequence_data) ((char *) tup + tup->t_hoff))->last_value;
	UnlockReleaseBuffer(buf);
	return result;
}

/*
 * Raises sequence seqrel to value, WAL-logged, as its owner: the table's
 * owner, whom the call acts as, may have been changed by a DBA, and
 * nextval is not checked either (nextval_internal).  setval runs no code
 * of anyone's.
 */
static void
raise_sequence(Relation seqrel, int64 value)
{
	Oid			save_user;
	int			save_sec;

	GetUserIdAndSecContext(&save_user, &save_sec);
	SetUserIdAndSecContext(seqrel->rd_rel->relowner,
						   save_sec | SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	DirectFunctionCall2(setval_oid, ObjectIdGetDatum(RelationGetRelid(seqrel)),
						Int64GetDatum(value));
	SetUserIdAndSecContext(save_user, save_sec);
}

/* Returns this database's block of sequence seq, or the slot to draw it into. */
static FenceBlock *
find_block(Oid seq, bool *found)
{
	FenceBlock *oldest = NULL;

	for (int i = 0; i < FENCE_SLOTS; i++)
	{
		FenceBlock *b = &fence_shared->blocks[i];

		if (b->dboid == MyDatabaseId && b->seq == seq)
		{
			*found = true;
			return b;
		}
		if (oldest == NULL || b->drawn_at < oldest->drawn_at)
			oldest = b;
	}
	*found = false;
	return oldest;
}

/*
 * Returns sequence seqrel's MAXVALUE.  Called right after nextval_internal,
 * which has just read the same pg_sequence entry: a cache hit, so no
 * catalog lock is waited for under the fence LWLock.
 */
static int64
sequence_max(Relation seqrel)
{
	HeapTuple	tup = SearchSysCache1(SEQRELID, ObjectIdGetDatum(RelationGetRelid(seqrel)));
	int64		max;

	if (!HeapTupleIsValid(tup))
		elog(ERROR, "cache lookup failed for sequence %u", RelationGetRelid(seqrel));
	max = ((Form_pg_sequence) GETSTRUCT(tup))->seqmax;
	ReleaseSysCache(tup);
	return max;
}

/*
 * Draws a new block into b, starting at its sequence's nextval or at
 * at_least, whichever is larger, and advancing the sequence to its end.
 * The block stops at a DBA's MAXVALUE, so that the claims below it get
 * their fences and the one past it fails as nextval does; a first value
 * above it is left to setval to refuse.
 */
static void
draw_block(FenceBlock *b, Relation seqrel, int64 at_least)
{
	int64		first = nextval_internal(RelationGetRelid(seqrel), false);
	int64		max = sequence_max(seqrel);
	int64		room;
	int64		limit;
	SeqPage		page;

	first = Max(first, at_least);
	if (first >= max)
		limit = first;
	else if (pg_sub_s64_overflow(max, first, &room) || room >= FENCE_BLOCK - 1)
		limit = first + (FENCE_BLOCK - 1);
	else
		limit = max;
	raise_sequence(seqrel, limit);
	page = read_seq_page(seqrel);

	b->dboid = MyDatabaseId;
	b->seq = RelationGetRelid(seqrel);
	b->lsn = page.lsn;
	b->next = first;
	b->limit = page.last_value == limit ? limit : first;	/* a DBA's nextval came between */
	b->drawn_at = ++fence_shared->draws;
}

/* Returns a fence of at least at_least from this database's block (see the header). */
static int64
next_fence_from_block(Oid seq, int64 at_least)
{
	Relation	seqrel = relation_open(seq, RowExclusiveLock);
	FenceBlock *b;
	bool		found;
	int64		fence;

	LWLockAcquire(fence_lock(), LW_EXCLUSIVE);
	b = find_block(seq, &found);
	if (found)
	{
		SeqPage		page = read_seq_page(seqrel);

		found = page.lsn == b->lsn && page.last_value == b->limit &&
			Max(b->next, at_least) <= b->limit;
	}
	if (!found)
		draw_block(b, seqrel, at_least);
	fence = Max(b->next, at_least);
	b->next = fence + 1;
	fence_lsn = b->lsn;
	LWLockRelease(fence_lock());
	relation_close(seqrel, NoLock);
	return fence;
}

/*
 * Returns a fence of at least at_least without shared memory: the
 * sequence's nextval, or at_least with the sequence raised to it when the
 * sequence is behind.  The raise can move the sequence back below a
 * concurrent draw only when several backends raise it at once (Citus,
 * whose floors are clock readings): a preloaded library serializes them.
 */
static int64
next_fence_unshared(Oid seq, int64 at_least)
{
	Relation	seqrel = relation_open(seq, RowExclusiveLock);
	int64		fence = nextval_internal(seq, false);

	if (fence < at_least)
	{
		raise_sequence(seqrel, at_least);
		fence = at_least;
	}
	fence_lsn = read_seq_page(seqrel).lsn;
	relation_close(seqrel, NoLock);
	return fence;
}

/* Returns a new fence of at least at_least from sequence seq. */
static int64
next_fence(Oid seq, int64 at_least)
{
	return fence_shared ? next_fence_from_block(seq, at_least) :
		next_fence_unshared(seq, at_least);
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
 * Only a backend's first claim from a new block of fences (without
 * preloading, from a new batch of the sequence's 32) gets here with an lsn
 * not yet confirmed.  Cancel and statement_timeout
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
 * Makes the fence drawn last durable before anyone sees it.
 *
 * A sequence's WAL is flushed only by some later commit, and with
 * synchronous_commit off by none before the WAL writer comes round.  Should
 * the server crash before then, the sequence would restart below a fence
 * already given to a client whose claim never committed (or whose
 * asynchronous commit was lost), and hand that fence out again: the old
 * client's complete would then succeed on the new owner's claim.  So the
 * claim flushes, whatever synchronous_commit says, up to the WAL record that
 * put the sequence past its fence: the block's draw (one flush per
 * FENCE_BLOCK fences), or without preloading the sequence's own WAL-ahead
 * (one per 32).  The same holds for a synchronous standby that is promoted
 * without that record, so the claim also waits for the synchronous standbys
 * to have it, where synchronous_commit asks commits to wait for them.  When
 * that WAL is already there it costs next to nothing.  Call it after
 * idem_call_end.
 */
void
idem_keys_flush_fence(void)
{
	XLogFlush(fence_lsn);
	wait_for_sync_standbys(fence_lsn);
}
