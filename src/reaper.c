/*-------------------------------------------------------------------------
 * reaper.c
 *	  The background reaper: deletes expired idempotency records.
 *
 * A launcher, registered at preload, connects to no database.  Every
 * idempotency.reaper_naptime it lists the databases that allow connections
 * and, one at a time, starts a short-lived worker in each; the worker exits
 * at once where the extension is not installed, otherwise deletes expired
 * records (the code of reap()) in batches of idempotency.reaper_batch, one
 * transaction each, until nothing expired is left, and exits.  No process
 * of ours stays connected to a database between runs.
 *
 * During a run the worker never waits for a heavyweight lock held by someone
 * else: before each batch it tries, without waiting, the locks that DROP
 * DATABASE, CREATE DATABASE ... TEMPLATE, DROP EXTENSION and DDL on the table
 * take first, and ends the run when one is taken.  So those commands wait at
 * most for the batch in flight and never fail because of the reaper.
 *
 * On a hot standby the launcher idles; it starts working after promotion.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_database.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "nodes/pg_list.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "citus.h"
#include "compat.h"
#include "gauges.h"
#include "guclist.h"
#include "keys.h"
#include "reaper.h"
#include "stats.h"

/* Seconds before the postmaster restarts a launcher that died. */
#define LAUNCHER_RESTART_S 5

/* The reaper's settings. */
static int	reaper_naptime_s = 60;
static int	reaper_batch = 10000;
static char *reaper_databases = NULL;

/* reaper_databases, parsed when it was set; empty: every database. */
static const IdemNameList *listed_databases = NULL;

/* A database the launcher will visit in this cycle. */
typedef struct ReapTarget
{
	Oid			oid;
	char		name[NAMEDATALEN];
} ReapTarget;

/* What the worker found before a batch. */
typedef enum BatchGate
{
	BATCH_GO,					/* locks held: reap */
	BATCH_ABSENT,				/* the extension is not installed here */
	BATCH_YIELD					/* someone needs the database or the table */
} BatchGate;

PGDLLEXPORT void idempotency_reaper_launcher_main(Datum main_arg);
PGDLLEXPORT void idempotency_reaper_worker_main(Datum main_arg);

PG_FUNCTION_INFO_V1(idempotency_reap);

static uint64 reap_expired(int batch);

/* Check hook of idempotency.reaper_databases: the list must parse, once, when set. */
static bool
check_reaper_databases(char **newval, void **extra, GucSource source)
{
	return idem_name_list_parse(*newval, "idempotency.reaper_databases", true, extra);
}

/* Assign hook of idempotency.reaper_databases: installs the parsed list. */
static void
assign_reaper_databases(const char *newval, void *extra)
{
	listed_databases = (const IdemNameList *) extra;
}

/*
 * Fills in what the launcher and the workers share: both connect (the
 * launcher to no database) and start on a hot standby too, where the
 * launcher idles until promotion.
 */
static void
init_worker(BackgroundWorker *worker, const char *function, const char *type)
{
	memset(worker, 0, sizeof(*worker));
	worker->bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker->bgw_start_time = BgWorkerStart_ConsistentState;
	strlcpy(worker->bgw_library_name, "idempotency", BGW_MAXLEN);
	strlcpy(worker->bgw_function_name, function, BGW_MAXLEN);
	strlcpy(worker->bgw_name, type, BGW_MAXLEN);
	strlcpy(worker->bgw_type, type, BGW_MAXLEN);
}

/*
 * Defines the reaper's settings and, while preloading, registers the
 * launcher; called from _PG_init.
 */
void
idem_reaper_init(void)
{
	BackgroundWorker worker;

	/* Expiry is not urgent: a minute is plenty. */
	DefineCustomIntVariable("idempotency.reaper_naptime",
							gettext_noop("Sets the time between runs of the background reaper."),
							NULL,
							&reaper_naptime_s, 60, 1, INT_MAX / 1000,
							PGC_SIGHUP, GUC_UNIT_S, NULL, NULL, NULL);

	/* One transaction per batch keeps locks and WAL bursts small. */
	DefineCustomIntVariable("idempotency.reaper_batch",
							gettext_noop("Sets how many records the reaper, and reap() by default, delete per transaction."),
							NULL,
							&reaper_batch, 10000, 1, INT_MAX,
							PGC_SIGHUP, 0, NULL, NULL, NULL);

	DefineCustomStringVariable("idempotency.reaper_databases",
							   gettext_noop("Sets the databases the background reaper visits."),
							   gettext_noop("A comma-separated list of database names; empty means every database where the extension is installed."),
							   &reaper_databases, "",
							   PGC_SIGHUP, GUC_LIST_INPUT,
							   check_reaper_databases, assign_reaper_databases, NULL);

	if (!process_shared_preload_libraries_in_progress)
		return;
	init_worker(&worker, "idempotency_reaper_launcher_main", "idempotency reaper launcher");
	worker.bgw_restart_time = LAUNCHER_RESTART_S;
	RegisterBackgroundWorker(&worker);
}

/* Applies a pending SIGHUP: the settings are re-read between steps. */
static void
reload_if_requested(void)
{
	if (ConfigReloadPending)
	{
		ConfigReloadPending = false;
		ProcessConfigFile(PGC_SIGHUP);
	}
}

/*
 * Reads pg_database and returns the databases to visit, allocated in cxt.
 * Without a list: every database that allows connections except templates
 * (a worker in template1 would make CREATE DATABASE fail).  With a list:
 * the listed ones that allow connections.
 */
static List *
databases_to_visit(MemoryContext cxt)
{
	List	   *targets = NIL;
	bool		every = (listed_databases == NULL || listed_databases->count == 0);
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;
	MemoryContext oldcxt;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	(void) GetTransactionSnapshot();

	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);
		ReapTarget *target;

		/* Neither closed databases nor ones a failed DROP left behind. */
		if (!db->datallowconn || db->datconnlimit == DATCONNLIMIT_INVALID_DB)
			continue;
		if (every ? db->datistemplate :
			!idem_name_list_contains(listed_databases, NameStr(db->datname),
									 strlen(NameStr(db->datname)), false))
			continue;

		oldcxt = MemoryContextSwitchTo(cxt);
		target = palloc(sizeof(ReapTarget));
		target->oid = db->oid;
		strlcpy(target->name, NameStr(db->datname), NAMEDATALEN);
		targets = lappend(targets, target);
		MemoryContextSwitchTo(oldcxt);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);

	CommitTransactionCommand();
	return targets;
}

/*
 * Takes a lock on a database object (dbid) or shared object (InvalidOid)
 * if it is free now; never waits.  Returns whether it is held.
 */
static bool
try_lock_object(Oid dbid, Oid classid, Oid objid, LOCKMODE mode)
{
	LOCKTAG		tag;
	LockAcquireResult res;

	SET_LOCKTAG_OBJECT(tag, dbid, classid, objid, 0);
	res = LockAcquire(&tag, mode, false, true);
	if (res == LOCKACQUIRE_NOT_AVAIL)
		return false;
	/* Whoever held it may have changed the catalogs: see those changes. */
	if (res == LOCKACQUIRE_OK)
		AcceptInvalidationMessages();
	return true;
}

/*
 * Exits when SIGTERM asked for it: quietly, and with code 1 so that the
 * postmaster starts the launcher again after a pg_terminate_backend (at
 * shutdown it does not).
 */
static void
launcher_exit_if_requested(void)
{
	if (ShutdownRequestPending)
		proc_exit(1);
}

/*
 * Waits until the worker has exited; asked to exit meanwhile, stops it too.
 * The postmaster sets our latch when the worker exits (bgw_notify_pid).
 */
static void
wait_for_worker(BackgroundWorkerHandle *handle)
{
	pid_t		pid;

	while (GetBackgroundWorkerPid(handle, &pid) != BGWH_STOPPED)
	{
		if (ShutdownRequestPending)
			TerminateBackgroundWorker(handle);
		launcher_exit_if_requested();
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_EXIT_ON_PM_DEATH, -1L,
						 WAIT_EVENT_BGWORKER_SHUTDOWN);
		ResetLatch(MyLatch);
		/* Also absorbs barriers, such as the one DROP DATABASE waits for. */
		CHECK_FOR_INTERRUPTS();
	}
}

/*
 * Tells whether the database is still there and nobody holds it in a mode
 * that excludes connections (DROP DATABASE between its start and commit).
 * Not starting a worker then spares it a failed connection.
 */
static bool
database_available(Oid dboid)
{
	bool		available;

	StartTransactionCommand();
	available = try_lock_object(InvalidOid, DatabaseRelationId, dboid,
								RowExclusiveLock) &&
		SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(dboid));
	CommitTransactionCommand();
	return available;
}

/*
 * Starts the worker for one database and waits until it has exited.
 * Returns false when no worker slot is free.
 */
static bool
reap_one_database(const ReapTarget *target)
{
	BackgroundWorker worker;
	BackgroundWorkerHandle *handle;

	init_worker(&worker, "idempotency_reaper_worker_main", "idempotency reaper");
	/* Whatever it leaves, the next cycle picks up: no restart. */
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency reaper for database %s",
			 target->name);
	worker.bgw_main_arg = ObjectIdGetDatum(target->oid);
	strlcpy(worker.bgw_extra, target->name, BGW_EXTRALEN);
	worker.bgw_notify_pid = MyProcPid;

	if (!RegisterDynamicBackgroundWorker(&worker, &handle))
		return false;
	wait_for_worker(handle);
	pfree(handle);
	return true;
}

/* Visits every database of this cycle, one worker at a time. */
static void
launcher_cycle(MemoryContext cxt)
{
	List	   *targets = databases_to_visit(cxt);
	ListCell   *lc;

	foreach(lc, targets)
	{
		ReapTarget *target = (ReapTarget *) lfirst(lc);

		CHECK_FOR_INTERRUPTS();
		launcher_exit_if_requested();
		if (!database_available(target->oid))
			continue;
		if (!reap_one_database(target))
		{
			ereport(WARNING,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("could not start the idempotency reaper for database \"%s\"",
							target->name),
					 errhint("Consider increasing the configuration parameter \"%s\".",
							 "max_worker_processes")));
			idem_stats_reap_failed(target->name,
								   _("could not start a background worker: no free slot"));
			break;
		}
	}
}

/* Main of the launcher: starts the per-database workers every naptime. */
void
idempotency_reaper_launcher_main(Datum main_arg)
{
	MemoryContext cycle_cxt;
	TimestampTz last_start;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	/* Like the logical replication launcher: no FATAL line when told to stop. */
	pqsignal(SIGTERM, SignalHandlerForShutdownRequest);
	BackgroundWorkerUnblockSignals();
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);

	cycle_cxt = AllocSetContextCreate(TopMemoryContext,
									  "idempotency reaper launcher",
									  ALLOCSET_DEFAULT_SIZES);

	/* The first run comes one naptime after start, like every other. */
	last_start = GetCurrentTimestamp();
	for (;;)
	{
		TimestampTz now;
		TimestampTz next;

		CHECK_FOR_INTERRUPTS();
		launcher_exit_if_requested();
		reload_if_requested();

		/* Recomputed each time, so that a reloaded naptime counts at once. */
		now = GetCurrentTimestamp();
		/* The clock stepped back: count the naptime from now, not from then. */
		if (now < last_start)
			last_start = now;
		next = TimestampTzPlusMilliseconds(last_start,
										   (int64) reaper_naptime_s * 1000);
		if (now >= next)
		{
			last_start = now;
			/* A standby cannot delete: idle until promotion. */
			if (!RecoveryInProgress())
			{
				launcher_cycle(cycle_cxt);
				MemoryContextReset(cycle_cxt);
			}
			continue;
		}

		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 (long) ((next - now + 999) / 1000),
						 PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}

/*
 * Takes, without waiting, the locks a batch needs, so that the commands
 * that conflict with it win:
 * - the database, in the mode a connecting backend takes (DROP DATABASE,
 *   CREATE DATABASE from it as a template, ALTER DATABASE RENAME);
 * - the table (DROP EXTENSION, DDL, LOCK TABLE).
 */
static BatchGate
lock_for_batch(void)
{
	Oid			nspoid;
	Oid			relid;

	if (!try_lock_object(InvalidOid, DatabaseRelationId, MyDatabaseId,
						 RowExclusiveLock))
		return BATCH_YIELD;

	if (!OidIsValid(get_extension_oid("idempotency", true)))
		return BATCH_ABSENT;

	nspoid = get_namespace_oid("idempotency", true);
	relid = OidIsValid(nspoid) ? get_relname_relid("keys", nspoid) : InvalidOid;
	if (!OidIsValid(relid))
		return BATCH_ABSENT;
	if (!ConditionalLockRelationOid(relid, RowExclusiveLock))
		return BATCH_YIELD;
	/* Dropped while we looked it up?  The lock brought the news. */
	if (get_relname_relid("keys", nspoid) != relid)
		return BATCH_YIELD;
	return BATCH_GO;
}

/*
 * After a full batch, rests as long as the batch took: the reaper then takes
 * at most half of a core, and the claims keep the rest.  A latch wait, so
 * that signals and barriers are handled at once.
 */
static void
rest_after(TimestampTz batch_start)
{
	long		ms = (long) ((GetCurrentTimestamp() - batch_start) / 1000);

	if (ms <= 0)
		return;
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/*
 * Reaps this database in batches, one transaction each, until a batch
 * comes back short.  Returns the rows deleted; *found tells whether the
 * extension was there, *batches how many batches deleted something.
 */
static uint64
reap_database(bool *found, int *batches)
{
	uint64		total = 0;

	*found = false;
	*batches = 0;
	for (;;)
	{
		int			batch;
		BatchGate	gate;
		uint64		n = 0;

		CHECK_FOR_INTERRUPTS();
		reload_if_requested();
		batch = reaper_batch;

		SetCurrentStatementStartTimestamp();
		StartTransactionCommand();
		PushActiveSnapshot(GetTransactionSnapshot());
		gate = lock_for_batch();
		if (gate == BATCH_GO)
		{
			if (!*found)
			{
				*found = true;
				idem_stats_add(IDEM_REAPER_RUNS, 1);
				pgstat_report_activity(STATE_RUNNING,
									   "reaping expired records of idempotency.keys");
			}
			n = reap_expired(batch);
		}
		PopActiveSnapshot();
		CommitTransactionCommand();
		pgstat_report_stat(false);

		if (gate == BATCH_ABSENT && !*found)
			ereport(DEBUG1,
					(errmsg_internal("idempotency is not installed in this database")));
		if (gate == BATCH_YIELD)
			ereport(DEBUG1,
					(errmsg_internal("idempotency reaper yields to a conflicting lock")));
		if (n > 0)
			(*batches)++;
		total += n;
		if (gate != BATCH_GO || n < (uint64) batch)
			return total;
		rest_after(GetCurrentStatementStartTimestamp());
	}
}

/*
 * Recounts the live figures of idempotency.stats where they are not exact
 * (gauges.c: after a restart, an overflow, a doubt), in a transaction of
 * its own, unless the table is distributed (the view counts through Citus).
 */
static void
recount_if_needed(void)
{
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (lock_for_batch() == BATCH_GO)
	{
		List	   *rels = idem_citus_local_rels();
		Oid			relid = idem_keys_catalog()->keys.relid;

		if (list_length(rels) == 1 && ((IdemKeysRel *) linitial(rels))->relid == relid &&
			idem_gauges_need_recount(relid))
		{
			pgstat_report_activity(STATE_RUNNING,
								   "recounting the records in progress of idempotency.keys");
			if (!idem_gauges_recount(relid))
				ereport(DEBUG1,
						(errmsg_internal("idempotency's live figures stay an estimate after a recount")));
		}
	}
	PopActiveSnapshot();
	CommitTransactionCommand();
}

/*
 * Overrides what the database or its owner may have set for clients, as
 * autovacuum does: a batch is bounded by its size, not by a timeout.
 */
static void
worker_settings(void)
{
	SetConfigOption("statement_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("lock_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);
	/* A database owner may make the database read-only by default: not for us. */
	SetConfigOption("default_transaction_read_only", "off", PGC_SUSET, PGC_S_OVERRIDE);

	/*
	 * A deletion lost in a crash only leaves an expired record, which claim
	 * already treats as absent and the next run deletes: no flush per batch.
	 */
	SetConfigOption("synchronous_commit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	/*
	 * The first deletion on a page after a checkpoint logs the whole page:
	 * compressed, the reaper's WAL delays the claims' commits much less
	 * (bench/reap.sh).  Only where lz4 exists (PG 15+ built with it), and
	 * unless the server already compresses.
	 */
	if (strcmp(GetConfigOption("wal_compression", false, false), "off") == 0)
		(void) set_config_option("wal_compression", "lz4", PGC_SUSET,
								 PGC_S_OVERRIDE, GUC_ACTION_SET, true,
								 DEBUG1, false);
}

/* Names the database in the context of errors raised while reaping. */
static void
reaper_error_context(void *arg)
{
	errcontext("idempotency reaper in database \"%s\"", (const char *) arg);
}

/* Main of a per-database worker: one run, then exit. */
void
idempotency_reaper_worker_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	char		dbname[NAMEDATALEN];
	MemoryContext cxt = CurrentMemoryContext;
	ErrorContextCallback errcallback;
	TimestampTz started;
	uint64		reaped;
	bool		found;
	int			batches;

	strlcpy(dbname, MyBgworkerEntry->bgw_extra, NAMEDATALEN);

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);

	worker_settings();

	errcallback.callback = reaper_error_context;
	errcallback.arg = dbname;
	errcallback.previous = error_context_stack;
	error_context_stack = &errcallback;

	started = GetCurrentTimestamp();
	PG_TRY();
	{
		recount_if_needed();
		reaped = reap_database(&found, &batches);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		/* One line in the log, the message in idempotency.stats, exit 0. */
		EmitErrorReport();
		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		AbortCurrentTransaction();
		idem_stats_reap_failed(dbname, edata->message);
		proc_exit(0);
	}
	PG_END_TRY();
	error_context_stack = errcallback.previous;

	if (found)
		idem_stats_reap_succeeded(dbname);
	if (reaped > 0)
		ereport(LOG,
				(errmsg("idempotency reaper deleted %llu expired records in database \"%s\" (batches: %d, elapsed: %.3f s)",
						(unsigned long long) reaped, dbname, batches,
						(double) (GetCurrentTimestamp() - started) / 1000000.0)));
	pgstat_report_activity(STATE_IDLE, NULL);
	proc_exit(0);
}

/*
 * Deletes up to batch expired records, oldest first, skipping locked ones;
 * counts them.  With Citus, from each local shard in turn (but those that a
 * move holds).
 */
static uint64
reap_expired(int batch)
{
	TimestampTz now = GetCurrentTimestamp();
	IdemCall	call;
	List	   *rels;
	ListCell   *lc;
	uint64		reaped = 0;

	idem_call_begin(&call);
	rels = idem_citus_local_rels();
	foreach(lc, rels)
	{
		if (reaped >= (uint64) batch)
			break;
		call.rel = *(IdemKeysRel *) lfirst(lc);
		reaped += idem_keys_reap(&call, batch - (int) reaped, now);
	}
	idem_call_end(&call);

	idem_stats_add(IDEM_REAPED, reaped);
	idem_stats_set_last_reap(now);
	return reaped;
}

/* reap(batch): deletes up to batch expired records and returns how many. */
Datum
idempotency_reap(PG_FUNCTION_ARGS)
{
	int32		batch = PG_ARGISNULL(0) ? reaper_batch : PG_GETARG_INT32(0);

	if (batch <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "batch")));
	PreventCommandIfReadOnly("idempotency.reap()");
	PG_RETURN_INT64((int64) reap_expired(batch));
}
