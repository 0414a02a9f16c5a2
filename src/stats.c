/*-------------------------------------------------------------------------
 * stats.c
 *	  The counters of the idempotency.stats view, in shared memory.
 *
 * They exist only when the library is preloaded; without it they read as
 * NULL.  Like pg_stat_statements, a call is counted when it happens, also
 * if its transaction later rolls back.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "stats.h"

typedef struct IdemStats
{
	pg_atomic_uint64 counters[IDEM_NUM_COUNTERS];
	pg_atomic_uint64 last_reap_at;	/* TimestampTz, 0 when never */
	pg_atomic_uint64 stats_reset_at;	/* TimestampTz */
	slock_t		error_lock;		/* protects the two fields below */
	char		error_db[NAMEDATALEN];	/* where the reaper last failed */
	char		error[256];		/* "" when it has not failed since */
} IdemStats;

static IdemStats *stats = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

PG_FUNCTION_INFO_V1(idempotency_stats_counters);
PG_FUNCTION_INFO_V1(idempotency_stats_reset);

/* Asks for the shared memory of the counters. */
static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(IdemStats)));
}

/* Creates or attaches to the counters at postmaster or backend start. */
static void
stats_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats = ShmemInitStruct("idempotency stats", sizeof(IdemStats), &found);
	if (!found)
	{
		for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
			pg_atomic_init_u64(&stats->counters[i], 0);
		pg_atomic_init_u64(&stats->last_reap_at, 0);
		pg_atomic_init_u64(&stats->stats_reset_at, (uint64) GetCurrentTimestamp());
		SpinLockInit(&stats->error_lock);
		stats->error_db[0] = '\0';
		stats->error[0] = '\0';
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Installs the shared memory hooks; called from _PG_init. */
void
idem_stats_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}

/* Adds n to a counter; a no-op without preloading. */
void
idem_stats_add(IdemCounter counter, uint64 n)
{
	if (stats)
		pg_atomic_fetch_add_u64(&stats->counters[counter], n);
}

/* Records when the reaper (or reap()) last ran. */
void
idem_stats_set_last_reap(TimestampTz at)
{
	if (stats)
		pg_atomic_write_u64(&stats->last_reap_at, (uint64) at);
}

/* Records that the reaper failed in database dbname, and why. */
void
idem_stats_reap_failed(const char *dbname, const char *message)
{
	if (!stats)
		return;
	SpinLockAcquire(&stats->error_lock);
	strlcpy(stats->error_db, dbname, sizeof(stats->error_db));
	strlcpy(stats->error, message, sizeof(stats->error));
	SpinLockRelease(&stats->error_lock);
}

/* Forgets the last failure when it was in dbname, where a run just succeeded. */
void
idem_stats_reap_succeeded(const char *dbname)
{
	if (!stats)
		return;
	SpinLockAcquire(&stats->error_lock);
	if (strcmp(stats->error_db, dbname) == 0)
		stats->error[0] = '\0';
	SpinLockRelease(&stats->error_lock);
}

/*
 * The columns of _stats_counters: the counters of version 1.0, the reaper's
 * figures, then the counters added since (1.2: claims_resumed), which the
 * SQL function of an older version lacks.
 */
#define OLD_COUNTERS IDEM_CLAIMS_RESUMED
#define COL_LAST_REAP_AT OLD_COUNTERS
#define COL_STATS_RESET_AT (OLD_COUNTERS + 1)
#define COL_LAST_REAP_ERROR (OLD_COUNTERS + 2)
#define NUM_COLS_1_0 (OLD_COUNTERS + 3)
#define NUM_COLS (IDEM_NUM_COUNTERS + 3)

/* Returns the counters as one row, all NULL without preloading. */
Datum
idempotency_stats_counters(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[NUM_COLS];
	bool		nulls[NUM_COLS];
	char		error_db[NAMEDATALEN];
	char		error[sizeof(stats->error)];
	uint64		ts;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	if (tupdesc->natts != NUM_COLS && tupdesc->natts != NUM_COLS_1_0)
		elog(ERROR, "stats function returns %d columns, expected %d",
			 tupdesc->natts, NUM_COLS);

	memset(nulls, !stats, sizeof(nulls));
	if (stats)
	{
		for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
			values[i < OLD_COUNTERS ? i : i + 3] =
				Int64GetDatum((int64) pg_atomic_read_u64(&stats->counters[i]));
		ts = pg_atomic_read_u64(&stats->last_reap_at);
		values[COL_LAST_REAP_AT] = TimestampTzGetDatum((TimestampTz) ts);
		nulls[COL_LAST_REAP_AT] = (ts == 0);
		values[COL_STATS_RESET_AT] =
			TimestampTzGetDatum((TimestampTz) pg_atomic_read_u64(&stats->stats_reset_at));
		SpinLockAcquire(&stats->error_lock);
		strlcpy(error_db, stats->error_db, sizeof(error_db));
		strlcpy(error, stats->error, sizeof(error));
		SpinLockRelease(&stats->error_lock);
		if (error[0] != '\0')
			values[COL_LAST_REAP_ERROR] =
				CStringGetTextDatum(psprintf(_("in database \"%s\": %s"), error_db, error));
		nulls[COL_LAST_REAP_ERROR] = (error[0] == '\0');
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

/* Zeroes the counters and notes when. */
Datum
idempotency_stats_reset(PG_FUNCTION_ARGS)
{
	if (!stats)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency statistics are not available"),
				 errhint("Add idempotency to shared_preload_libraries and restart the server.")));
	for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
		pg_atomic_write_u64(&stats->counters[i], 0);
	pg_atomic_write_u64(&stats->last_reap_at, 0);
	SpinLockAcquire(&stats->error_lock);
	stats->error[0] = '\0';
	SpinLockRelease(&stats->error_lock);
	pg_atomic_write_u64(&stats->stats_reset_at, (uint64) GetCurrentTimestamp());
	PG_RETURN_VOID();
}
