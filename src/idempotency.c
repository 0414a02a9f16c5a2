/*-------------------------------------------------------------------------
 * idempotency.c
 *	  The idempotency extension: module magic, the settings of the SQL API,
 *	  and _PG_init, which initialises each part.
 *
 * The parts, one file each:
 *	  args.c		checks of the API's arguments
 *	  catalog.c		what the extension knows of its objects: the table's columns, owner
 *	  fence.c		fences: drawn from the sequence, made durable
 *	  keys.c		the calls, and their statements on idempotency.keys (SPI plans)
 *	  keysrel.c		a relation of records: its columns and key index, for the direct paths
 *	  keysindex.c	a relation open with its indexes for a direct write, their entries
 *	  keysread.c	claim's reads of a record, without the executor
 *	  keyswrite.c	claim's insert and complete's update, without the executor
 *	  citus.c		idempotency.keys distributed with Citus: shards, NULL-scope guard
 *	  claim.c		claim()
 *	  record.c		complete(), release(), extend(), checkpoint(), lookup()
 *	  headers.c		the response headers that complete() stores
 *	  fingerprint.c	fingerprint(), fingerprint_json()
 *	  stats.c		the counters of idempotency.stats
 *	  wait.c		claims waiting for an owner to finish, or for a writer's transaction
 *	  reaper.c		the background reaper and reap()
 *	  guclist.c		settings that hold a list of names
 *	  shard.c		shard_hash(), shard_of()
 * Dependencies point one way: towards keys.c, catalog.c, fence.c,
 * stats.c, wait.c and this file's settings; no two files use each other.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "fmgr.h"
#include "utils/guc.h"

#include "citus.h"
#include "compat.h"
#include "fence.h"
#include "gauges.h"
#include "headers.h"
#include "idempotency.h"
#include "reaper.h"
#include "stats.h"
#include "wait.h"

PG_MODULE_MAGIC;

/* Settings of the SQL API: see define_settings for what each is for. */
int			idem_lease_ms = 60000;
int			idem_retention_s = 86400;
char	   *idem_scope = NULL;
int			idem_max_response_bytes = 1024 * 1024;
bool		idem_store_server_errors = false;

/*
 * The largest response a record may store: a text-format replay sends a
 * body as hex, twice its size, and PostgreSQL builds no message over 1 GB.
 */
#define MAX_RESPONSE_BYTES_LIMIT (511 * 1024 * 1024)

void		_PG_init(void);

/* Defines the settings of the SQL API. */
static void
define_settings(void)
{
	/*
	 * A lease is how long an owner that stops answering is presumed alive:
	 * long enough for the slowest handler, short enough that a retry after a
	 * crash is not kept waiting.  Milliseconds, so that tests can use short
	 * ones.
	 */
	DefineCustomIntVariable("idempotency.lease",
							gettext_noop("Sets the default lease of a claim."),
							gettext_noop("After this long without complete, release, extend or checkpoint, a retry may take the claim over."),
							&idem_lease_ms, 60 * 1000, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS, NULL, NULL, NULL);

	/*
	 * Retention is how long a record answers retries.  Seconds, because
	 * records are often kept for days or weeks.
	 */
	DefineCustomIntVariable("idempotency.retention",
							gettext_noop("Sets the default time a record is kept, counted from its creation."),
							NULL,
							&idem_retention_s, 24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S, NULL, NULL, NULL);

	/* An auth layer sets the scope once per request with SET LOCAL. */
	DefineCustomStringVariable("idempotency.scope",
							   gettext_noop("Sets the scope of keys for calls that name none."),
							   gettext_noop("Set it per request, e.g. SET LOCAL idempotency.scope = 'acct_42'."),
							   &idem_scope, "",
							   PGC_USERSET, 0, NULL, NULL, NULL);

	/*
	 * Stored responses live in the table and in the WAL: a DBA's limit, not
	 * the application's, like pg_stat_statements' (ALTER ROLE ... SET works).
	 */
	DefineCustomIntVariable("idempotency.max_response_bytes",
							gettext_noop("Sets the largest response (body and headers) that complete stores, and the largest recovery point that checkpoint stores."),
							NULL,
							&idem_max_response_bytes, 1024 * 1024, 0, MAX_RESPONSE_BYTES_LIMIT,
							PGC_SUSET, GUC_UNIT_BYTE, NULL, NULL, NULL);

	/* A 5xx is usually transient: by default the retry runs again. */
	DefineCustomBoolVariable("idempotency.store_server_errors",
							 gettext_noop("Stores 5xx responses for replay instead of releasing the claim."),
							 NULL,
							 &idem_store_server_errors, false,
							 PGC_USERSET, 0, NULL, NULL, NULL);

	/* Credentials and session cookies must never be replayed to anyone. */
	DefineCustomStringVariable("idempotency.header_denylist",
							   gettext_noop("Sets the response headers that complete never stores."),
							   gettext_noop("A comma-separated list of header names, case-insensitive; empty stores every header."),
							   &idem_header_denylist,
							   "set-cookie, authorization, proxy-authorization, cookie, www-authenticate",
							   PGC_SUSET, GUC_LIST_INPUT,
							   idem_denylist_check, idem_denylist_assign, NULL);
}

/* Initialises each part: the settings, and when preloaded, shared memory and the reaper. */
void
_PG_init(void)
{
	define_settings();
	idem_fence_init();
	idem_citus_init();
	idem_reaper_init();
	idem_stats_init();
	idem_gauges_init();
	idem_wait_init();
	MarkGUCPrefixReserved("idempotency");
}
