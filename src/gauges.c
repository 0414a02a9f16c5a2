/*-------------------------------------------------------------------------
 * gauges.c
 *	  The live figures of idempotency.stats, rows_in_progress and
 *	  oldest_lease_expires_at, and the leases that ended in a window
 *	  (leases_ended, for alerting), kept in shared memory (preloaded only)
 *	  from the API's own writes, so that no index of the records in progress
 *	  is needed and complete's update stays HOT.
 *
 * Shared memory holds, per database, the records in progress of its
 * idempotency.keys: a hash of (database, fence) -> end of the lease, the
 * fence being unique to a claim (a takeover or a reset draws a new one).
 * Each write of the API notes what it did (a claim began, ended, or moved
 * its lease) in a list of its transaction, tagged with the subtransaction:
 * a rolled-back savepoint drops its notes, a rolled-back transaction
 * applies none.  They are applied at pre-commit, while the transaction still
 * holds the row locks of the records it wrote, so that the notes of two
 * transactions that wrote one record are applied in the order they wrote it.
 * A transaction that then fails to commit (a serialization failure found at
 * commit, another module's pre-commit error) has applied notes that did not
 * happen: the figures are then marked inexact until a recount.  So is a
 * PREPARE TRANSACTION (applied at prepare: a ROLLBACK PREPARED would undo
 * writes the figures kept).
 *
 * The figures are exact only after a recount: at start (shared memory is
 * empty after a restart or a crash), when the hash overflowed, after a
 * doubt as above, and after the extension was made again.  The background
 * reaper recounts at its next run where they are inexact, and
 * idempotency.stats_recount() at once.  A recount reads the records in
 * progress under a snapshot taken once every transaction that applied
 * notes before it began has ended; the notes applied while it counts are
 * kept aside and replayed on top of the count for the transactions that the
 * count's snapshot does not see.
 *
 * Writes a DBA makes with plain SQL on the table are not seen: the figures
 * stay wrong (but marked exact) until the next stats_recount().
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "catalog.h"
#include "compat.h"
#include "gauges.h"

/* Records in progress tracked, over all databases, before the figures overflow. */
#define GAUGE_CLAIMS 65536
/* Databases whose figures are kept. */
#define GAUGE_DATABASES 64
/* Notes kept aside while a recount counts; more make it fail (retried later). */
#define GAUGE_ASIDE 16384
/* How long a recount waits for the transactions that applied notes before it. */
#define RECOUNT_WAIT_MS 5000

typedef enum NoteKind
{
	NOTE_CLAIMED,				/* a claim began: fence, lease_end */
	NOTE_ENDED,					/* it ended (completed, released, reaped, replaced) */
	NOTE_LEASED					/* its lease moved to lease_end */
} NoteKind;

typedef struct Note
{
	NoteKind	kind;
	int64		fence;
	TimestampTz lease_end;
	union
	{
		SubTransactionId subid; /* in a transaction's list */
		TransactionId xid;		/* in the notes kept aside */
	}			by;
} Note;

typedef struct ClaimKey
{
	Oid			dboid;
	int64		fence;
} ClaimKey;

typedef struct ClaimEntry
{
	ClaimKey	key;
	TimestampTz lease_end;
} ClaimEntry;

typedef struct GaugeDb
{
	Oid			dboid;			/* InvalidOid: a free slot */
	Oid			relid;			/* its idempotency.keys */
	bool		exact;			/* counted, and nothing made it doubtful since */
	uint64		doubts;			/* how often it was made doubtful */
	int64		rows;			/* its entries in the hash */
	uint64		last_used;		/* when notes were last applied to it */
} GaugeDb;

typedef struct Gauges
{
	LWLock	   *lock;			/* protects everything here and the hash */
	uint32		epoch;			/* which of unfinished a pre-commit counts in */
	uint32		unfinished[2];	/* transactions that applied notes, not yet ended */
	int64		entries;		/* entries in the hash, all databases */
	uint64		clock;			/* ticks at each use of a slot */
	int			recounting;		/* the slot being recounted, or -1 */
	int			naside;			/* notes kept aside for it */
	bool		aside_full;
	GaugeDb		dbs[GAUGE_DATABASES];
	Note		aside[GAUGE_ASIDE];
} Gauges;

static Gauges *gauges = NULL;
static HTAB *claims = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* This transaction's notes, in TopTransactionContext; NULL when none. */
static Note *notes = NULL;
static int	nnotes = 0;
static int	notes_size = 0;
static Oid	notes_relid = InvalidOid;
/* The epoch its notes were applied in, or -1 while they are not. */
static int	applied_epoch = -1;

PG_FUNCTION_INFO_V1(idempotency_stats_gauges);
PG_FUNCTION_INFO_V1(idempotency_stats_recount);
PG_FUNCTION_INFO_V1(idempotency_stats_leases_ended);

/* Asks for the shared memory of the gauges. */
static void
gauges_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(Gauges)) +
						   hash_estimate_size(GAUGE_CLAIMS, sizeof(ClaimEntry)));
	RequestNamedLWLockTranche("idempotency gauges", 1);
}

/* Creates or attaches to the gauges at postmaster or backend start. */
static void
gauges_shmem_startup(void)
{
	bool		found;
	HASHCTL		info;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	gauges = ShmemInitStruct("idempotency gauges", sizeof(Gauges), &found);
	if (!found)
	{
		memset(gauges, 0, sizeof(Gauges));
		gauges->lock = &(GetNamedLWLockTranche("idempotency gauges"))->lock;
		gauges->recounting = -1;
	}
	info.keysize = sizeof(ClaimKey);
	info.entrysize = sizeof(ClaimEntry);
	claims = ShmemInitHash("idempotency claims in progress", GAUGE_CLAIMS, GAUGE_CLAIMS,
						   &info, HASH_ELEM | HASH_BLOBS);
	LWLockRelease(AddinShmemInitLock);
}

/* Forgets this transaction's notes (their memory goes with the transaction). */
static void
notes_forget(void)
{
	notes = NULL;
	nnotes = notes_size = 0;
	notes_relid = InvalidOid;
	applied_epoch = -1;
}

/* Removes every entry of a database's slot from the hash. */
static void
slot_clear(GaugeDb *db)
{
	HASH_SEQ_STATUS status;
	ClaimEntry *e;

	hash_seq_init(&status, claims);
	while ((e = hash_seq_search(&status)) != NULL)
	{
		if (e->key.dboid == db->dboid)
		{
			hash_search(claims, &e->key, HASH_REMOVE, NULL);
			gauges->entries--;
		}
	}
	db->rows = 0;
}

/*
 * The slot to take for a database that has none: a free one, or else the
 * least recently used (a dropped database's, or one whose figures become
 * inexact until its reaper recounts them), never the one being recounted.
 */
static GaugeDb *
slot_to_take(void)
{
	GaugeDb    *oldest = NULL;

	for (int i = 0; i < GAUGE_DATABASES; i++)
	{
		GaugeDb    *db = &gauges->dbs[i];

		if (db->dboid == InvalidOid)
			return db;
		if (i != gauges->recounting && (oldest == NULL || db->last_used < oldest->last_used))
			oldest = db;
	}
	slot_clear(oldest);
	return oldest;
}

/*
 * The slot of this database's figures for its table relid, made (inexact)
 * when create; NULL when there is none.  A slot of another table of the
 * same database (the extension was dropped and made again) is cleared
 * first.  Lock held exclusively when create.
 */
static GaugeDb *
slot_for(Oid relid, bool create)
{
	GaugeDb    *slot;

	for (int i = 0; i < GAUGE_DATABASES; i++)
	{
		GaugeDb    *db = &gauges->dbs[i];

		if (db->dboid == MyDatabaseId)
		{
			if (db->relid == relid)
			{
				if (create)
					db->last_used = ++gauges->clock;
				return db;
			}
			if (!create)
				return NULL;
			slot_clear(db);
			db->relid = relid;
			db->exact = false;
			db->doubts++;
			db->last_used = ++gauges->clock;
			return db;
		}
	}
	if (!create)
		return NULL;
	slot = slot_to_take();
	slot->dboid = MyDatabaseId;
	slot->relid = relid;
	slot->exact = false;
	slot->doubts++;
	slot->last_used = ++gauges->clock;
	return slot;
}

/* Makes a database's figures inexact until a recount. */
static void
slot_doubt(GaugeDb *db)
{
	db->exact = false;
	db->doubts++;
}

/* Applies one note to a database's entries. */
static void
note_apply(GaugeDb *db, const Note *n)
{
	ClaimKey	key;
	ClaimEntry *e;
	bool		found;

	memset(&key, 0, sizeof(key));
	key.dboid = db->dboid;
	key.fence = n->fence;
	switch (n->kind)
	{
		case NOTE_CLAIMED:
			e = hash_search(claims, &key, HASH_FIND, NULL);
			if (e == NULL)
			{
				if (gauges->entries >= GAUGE_CLAIMS ||
					(e = hash_search(claims, &key, HASH_ENTER_NULL, &found)) == NULL)
				{
					slot_doubt(db);	/* overflow: a recount tells whether it fits now */
					return;
				}
				gauges->entries++;
				db->rows++;
			}
			e->lease_end = n->lease_end;
			break;
		case NOTE_ENDED:
			if (hash_search(claims, &key, HASH_REMOVE, NULL) != NULL)
			{
				gauges->entries--;
				db->rows--;
			}
			break;
		case NOTE_LEASED:
			e = hash_search(claims, &key, HASH_FIND, NULL);
			if (e != NULL)
				e->lease_end = n->lease_end;
			break;
	}
}

/*
 * Applies this transaction's notes to the shared figures (at pre-commit or
 * pre-prepare), and keeps them aside for a recount of this database.
 */
static void
notes_apply(bool prepare)
{
	TransactionId xid = GetTopTransactionIdIfAny();
	GaugeDb    *db;

	LWLockAcquire(gauges->lock, LW_EXCLUSIVE);
	db = slot_for(notes_relid, true);
	if (db != NULL)
	{
		bool		aside = (gauges->recounting == db - gauges->dbs);

		for (int i = 0; i < nnotes; i++)
		{
			note_apply(db, &notes[i]);
			if (!aside)
				continue;
			if (gauges->naside >= GAUGE_ASIDE)
			{
				gauges->aside_full = true;
				aside = false;
				continue;
			}
			gauges->aside[gauges->naside] = notes[i];
			gauges->aside[gauges->naside++].by.xid = xid;
		}
		if (prepare)
			slot_doubt(db);
	}
	applied_epoch = gauges->epoch & 1;
	gauges->unfinished[applied_epoch]++;
	LWLockRelease(gauges->lock);
}

/*
 * Ends this transaction's part: a transaction that applied its notes and
 * then failed makes its database's figures doubtful.
 */
static void
notes_end(bool failed)
{
	if (applied_epoch >= 0)
	{
		LWLockAcquire(gauges->lock, LW_EXCLUSIVE);
		gauges->unfinished[applied_epoch]--;
		if (failed)
		{
			GaugeDb    *db = slot_for(notes_relid, false);

			if (db != NULL)
				slot_doubt(db);
		}
		LWLockRelease(gauges->lock);
	}
	notes_forget();
}

/* Applies the notes at (pre-)commit and forgets them when the transaction ends. */
static void
gauges_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			if (nnotes > 0 && applied_epoch < 0)
				notes_apply(event == XACT_EVENT_PRE_PREPARE);
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PREPARE:
			notes_end(false);
			break;
		case XACT_EVENT_ABORT:
			notes_end(true);
			break;
		default:
			break;
	}
}

/* Drops the notes of a subtransaction that rolls back (and of its children). */
static void
gauges_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	if (event != SUBXACT_EVENT_ABORT_SUB)
		return;
	while (nnotes > 0 && notes[nnotes - 1].by.subid >= mySubid)
		nnotes--;
}

/* Installs the shared memory hooks and the transaction callbacks; called from _PG_init. */
void
idem_gauges_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = gauges_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = gauges_shmem_startup;
	RegisterXactCallback(gauges_xact_callback, NULL);
	RegisterSubXactCallback(gauges_subxact_callback, NULL);
}

/*
 * Notes a write of the table relid, when it is idempotency.keys itself (not
 * a Citus shard, whose figures the view counts through Citus).
 */
static void
note(NoteKind kind, Oid relid, int64 fence, TimestampTz lease_end)
{
	Note	   *n;

	if (gauges == NULL || relid != idem_keys_catalog()->keys.relid)
		return;
	if (nnotes == notes_size)
	{
		notes_size = Max(16, notes_size * 2);
		notes = notes == NULL ?
			MemoryContextAlloc(TopTransactionContext, notes_size * sizeof(Note)) :
			repalloc(notes, notes_size * sizeof(Note));
	}
	n = &notes[nnotes++];
	n->kind = kind;
	n->fence = fence;
	n->lease_end = lease_end;
	n->by.subid = GetCurrentSubTransactionId();
	notes_relid = relid;
}

/* Notes that a claim with this fence began, its lease ending at lease_end. */
void
idem_gauges_claimed(Oid relid, int64 fence, TimestampTz lease_end)
{
	note(NOTE_CLAIMED, relid, fence, lease_end);
}

/* Notes that the claim of this fence is no longer in progress (if it was). */
void
idem_gauges_ended(Oid relid, int64 fence)
{
	note(NOTE_ENDED, relid, fence, 0);
}

/* Notes that the lease of the claim of this fence now ends at lease_end. */
void
idem_gauges_leased(Oid relid, int64 fence, TimestampTz lease_end)
{
	note(NOTE_LEASED, relid, fence, lease_end);
}

/* Whether this database's figures of table relid need a recount. */
bool
idem_gauges_need_recount(Oid relid)
{
	GaugeDb    *db;
	bool		need;

	if (gauges == NULL)
		return false;
	LWLockAcquire(gauges->lock, LW_SHARED);
	db = slot_for(relid, false);
	need = (db == NULL || !db->exact);
	LWLockRelease(gauges->lock);
	return need;
}

/*
 * Waits until the transactions that applied notes in epoch have ended;
 * false when that takes longer than RECOUNT_WAIT_MS.
 */
static bool
wait_for_epoch(uint32 epoch)
{
	TimestampTz give_up = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), RECOUNT_WAIT_MS);

	for (;;)
	{
		uint32		n;

		LWLockAcquire(gauges->lock, LW_SHARED);
		n = gauges->unfinished[epoch & 1];
		LWLockRelease(gauges->lock);
		if (n == 0)
			return true;
		if (GetCurrentTimestamp() >= give_up)
			return false;
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 1L, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

/*
 * Reads, under snapshot, the records in progress of idempotency.keys into
 * *out (fence and end of lease, as notes of claims); returns how many, or
 * -1 when a prepared transaction of this database may still change them.
 */
static int64
count_in_progress(Snapshot snapshot, Note **out)
{
	SPIPlanPtr	plan;
	int64		n;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT 1 FROM pg_catalog.pg_prepared_xacts p WHERE p.database"
					" OPERATOR(pg_catalog.=) pg_catalog.current_database() LIMIT 1",
					true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read pg_prepared_xacts");
	if (SPI_processed > 0)
	{
		SPI_finish();
		return -1;
	}
	plan = SPI_prepare("SELECT k.fence, k.lease_expires_at FROM ONLY idempotency.keys k"
					   " WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state",
					   0, NULL);
	if (plan == NULL ||
		SPI_execute_snapshot(plan, NULL, NULL, snapshot, InvalidSnapshot, true, false, 0)
		!= SPI_OK_SELECT)
		elog(ERROR, "could not count the records in progress");
	/* One more than fits is enough to tell that they do not. */
	n = Min((int64) SPI_processed, GAUGE_CLAIMS + 1);
	*out = SPI_palloc(Max(n, 1) * sizeof(Note));
	for (int64 i = 0; i < n; i++)
	{
		bool		isnull;
		Datum		fence = SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1, &isnull);
		Datum		lease_end = SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 2, &isnull);

		(*out)[i].kind = NOTE_CLAIMED;
		(*out)[i].fence = DatumGetInt64(fence);
		(*out)[i].lease_end = isnull ? DT_NOBEGIN : DatumGetTimestampTz(lease_end);
	}
	SPI_finish();
	return n;
}

/*
 * Rebuilds db's entries from the counted records and the notes kept aside
 * of the transactions that the count's snapshot does not see; the figures
 * become exact unless something made them doubtful since doubts.
 */
static void
rebuild(GaugeDb *db, const Note *counted, int64 n, Snapshot snapshot, uint64 doubts)
{
	slot_clear(db);
	for (int64 i = 0; i < n; i++)
		note_apply(db, &counted[i]);
	for (int i = 0; i < gauges->naside; i++)
		if (XidInMVCCSnapshot(gauges->aside[i].by.xid, snapshot))
			note_apply(db, &gauges->aside[i]);
	db->exact = (db->doubts == doubts && !gauges->aside_full);
}

/*
 * Ends a recount: the notes are no longer kept aside.  Also on an error and
 * on a FATAL exit (a reaper told to stop while it waits).
 */
static void
recount_end(int code, Datum arg)
{
	LWLockAcquire(gauges->lock, LW_EXCLUSIVE);
	gauges->recounting = -1;
	gauges->naside = 0;
	gauges->aside_full = false;
	LWLockRelease(gauges->lock);
}

/*
 * Counts once the transactions of old_epoch have ended, and rebuilds db's
 * figures; returns whether they are exact.
 */
static bool
recount_now(GaugeDb *db, uint32 old_epoch, uint64 doubts)
{
	Snapshot	snapshot;
	Note	   *counted = NULL;
	int64		n;
	bool		exact = false;

	if (!wait_for_epoch(old_epoch))
		return false;
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	n = count_in_progress(snapshot, &counted);
	if (n >= 0)
	{
		LWLockAcquire(gauges->lock, LW_EXCLUSIVE);
		rebuild(db, counted, n, snapshot, doubts);
		exact = db->exact;
		LWLockRelease(gauges->lock);
	}
	UnregisterSnapshot(snapshot);
	return exact;
}

/*
 * Recounts this database's records in progress of table relid (its
 * idempotency.keys); returns whether the figures are exact now.  Runs in
 * the caller's transaction, as a role that reads the table; false at once
 * when another recount runs.
 */
bool
idem_gauges_recount(Oid relid)
{
	GaugeDb    *db;
	uint32		old_epoch;
	uint64		doubts;
	volatile bool exact = false;

	if (gauges == NULL)
		return false;
	/* Its own writes would be counted, then applied again at commit. */
	if (nnotes > 0)
		ereport(ERROR,
				(errcode(ERRCODE_ACTIVE_SQL_TRANSACTION),
				 errmsg("cannot recount idempotency statistics in a transaction that wrote idempotency records"),
				 errhint("Recount in a transaction of its own.")));
	LWLockAcquire(gauges->lock, LW_EXCLUSIVE);
	db = slot_for(relid, true);
	if (db == NULL || gauges->recounting >= 0)
	{
		LWLockRelease(gauges->lock);
		return false;
	}
	gauges->recounting = db - gauges->dbs;
	gauges->naside = 0;
	gauges->aside_full = false;
	doubts = db->doubts;
	old_epoch = gauges->epoch++;
	LWLockRelease(gauges->lock);

	PG_ENSURE_ERROR_CLEANUP(recount_end, (Datum) 0);
	{
		exact = recount_now(db, old_epoch, doubts);
	}
	PG_END_ENSURE_ERROR_CLEANUP(recount_end, (Datum) 0);
	recount_end(0, (Datum) 0);
	return exact;
}

/*
 * The figures of this database's table relid: rows in progress, the
 * earliest end of their leases, and whether they are exact; NULLs when
 * there are none (not preloaded, another table, no free slot).
 */
Datum
idempotency_stats_gauges(PG_FUNCTION_ARGS)
{
	Oid			relid = PG_GETARG_OID(0);
	TupleDesc	tupdesc;
	Datum		values[3] = {0};
	bool		nulls[3] = {true, true, true};
	GaugeDb    *db;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	if (gauges != NULL)
	{
		LWLockAcquire(gauges->lock, LW_SHARED);
		db = slot_for(relid, false);
		if (db != NULL)
		{
			HASH_SEQ_STATUS status;
			ClaimEntry *e;
			TimestampTz oldest = DT_NOEND;

			hash_seq_init(&status, claims);
			while ((e = hash_seq_search(&status)) != NULL)
				if (e->key.dboid == db->dboid && e->lease_end < oldest)
					oldest = e->lease_end;
			values[0] = Int64GetDatum(db->rows);
			nulls[0] = false;
			values[1] = TimestampTzGetDatum(oldest);
			nulls[1] = (db->rows == 0);
			values[2] = BoolGetDatum(db->exact);
			nulls[2] = false;
		}
		LWLockRelease(gauges->lock);
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

/*
 * The records in progress of this database's table relid whose lease ended
 * from ended_from to ended_to (both included); NULL when the figures are not
 * exact (or there are none).  Reads the entries, never the table.
 */
Datum
idempotency_stats_leases_ended(PG_FUNCTION_ARGS)
{
	Oid			relid = PG_GETARG_OID(0);
	TimestampTz ended_from = PG_GETARG_TIMESTAMPTZ(1);
	TimestampTz ended_to = PG_GETARG_TIMESTAMPTZ(2);
	int64		ended = 0;
	bool		exact = false;
	GaugeDb    *db;

	if (gauges == NULL)
		PG_RETURN_NULL();
	LWLockAcquire(gauges->lock, LW_SHARED);
	db = slot_for(relid, false);
	if (db != NULL && db->exact)
	{
		HASH_SEQ_STATUS status;
		ClaimEntry *e;

		exact = true;
		hash_seq_init(&status, claims);
		while ((e = hash_seq_search(&status)) != NULL)
			if (e->key.dboid == db->dboid &&
				e->lease_end >= ended_from && e->lease_end <= ended_to)
				ended++;
	}
	LWLockRelease(gauges->lock);
	if (!exact)
		PG_RETURN_NULL();
	PG_RETURN_INT64(ended);
}

/* stats_recount(): recounts the figures now; returns whether they are exact. */
Datum
idempotency_stats_recount(PG_FUNCTION_ARGS)
{
	if (gauges == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency statistics are not available"),
				 errhint("Add idempotency to shared_preload_libraries and restart the server.")));
	PG_RETURN_BOOL(idem_gauges_recount(idem_keys_catalog()->keys.relid));
}
