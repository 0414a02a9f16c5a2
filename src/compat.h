/*-------------------------------------------------------------------------
 * compat.h
 *	  The differences between the PostgreSQL majors the extension supports
 *	  (15, 17 and 18; 16 compiles), kept in one place.  Each shim sits after
 *	  the headers that declare what it renames: include this file last.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "miscadmin.h"
#include "utils/guc.h"
#include "utils/wait_event.h"

#if PG_VERSION_NUM < 150000
#error "idempotency needs PostgreSQL 15 or later"
#endif

/* PG 16 split the varlena macros (VARDATA_ANY, VARSIZE_ANY_EXHDR) out of postgres.h. */
#if PG_VERSION_NUM >= 160000
#include "varatt.h"
#endif

/* PG 16 removed Abs() from c.h. */
#ifndef Abs
#define Abs(x) ((x) >= 0 ? (x) : -(x))
#endif

/* Minor releases before 15.4 lack this marker of a half-dropped database. */
#ifndef DATCONNLIMIT_INVALID_DB
#define DATCONNLIMIT_INVALID_DB -2
#endif

/* PG 16 exported guc_malloc; before it, a check hook's extra block comes from malloc. */
#if PG_VERSION_NUM < 160000
#define guc_malloc(elevel, size) malloc(size)
#endif

/* PG 16 made table_tuple_update say which indexes need new entries (a macro: tableam.h need not be included). */
#if PG_VERSION_NUM >= 160000
#define IdemUpdateIndexes TU_UpdateIndexes
#define IDEM_UPDATE_INDEXES_NEEDED(u) ((u) != TU_None)
#define IDEM_UPDATE_SUMMARIZING_ONLY(u) ((u) == TU_Summarizing)
#define IDEM_INDEX_SUMMARIZING(info) ((info)->ii_Summarizing)
#else
#define IdemUpdateIndexes bool
#define IDEM_UPDATE_INDEXES_NEEDED(u) (u)
#define IDEM_UPDATE_SUMMARIZING_ONLY(u) false
#define IDEM_INDEX_SUMMARIZING(info) false
#endif

/*
 * PG 17 added RestrictSearchPath(), which maintenance commands call when they
 * run a table owner's code: the same setting, made the same way, before it.
 */
#if PG_VERSION_NUM < 170000
#define GUC_SAFE_SEARCH_PATH "pg_catalog, pg_temp"
#define RestrictSearchPath() \
	((void) set_config_option("search_path", GUC_SAFE_SEARCH_PATH, PGC_USERSET, \
							  PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false))
#endif

/*
 * PG 18 gave ConditionalXactLockTableWait a flag to log the failure (the
 * log_lock_failures setting, meant for NOWAIT and SKIP LOCKED).  Ours is the
 * probe before a timed wait, not a refusal the user asked for: never logged.
 */
#if PG_VERSION_NUM >= 180000
#define ConditionalXactLockTableWait(xid) ConditionalXactLockTableWait(xid, false)
#endif

/*
 * PG 18 lets an index scan count its searches for EXPLAIN ANALYZE
 * (IndexScanInstrumentation); our scans are not in a plan: none.
 */
#if PG_VERSION_NUM >= 180000
#define index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan(heap, index, snapshot, NULL, nkeys, norderbys)
#endif

/*
 * PG 18's relcache remembers a deferrable primary key too and returns it
 * only when asked.  The executor-free writes rely on an immediate one (a
 * unique check at insert time), as RelationGetPrimaryKeyIndex gave before 18.
 */
#if PG_VERSION_NUM >= 180000
#define RelationGetPrimaryKeyIndex(rel) RelationGetPrimaryKeyIndex(rel, false)
#endif

#endif							/* IDEMPOTENCY_COMPAT_H */
