/*-------------------------------------------------------------------------
 * compat.h
 *	  The differences between PostgreSQL 13 and 17 that the extension meets,
 *	  kept in one place.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "miscadmin.h"
#include "utils/guc.h"

/* PG 16 split the varlena macros (VARDATA_ANY, VARSIZE_ANY_EXHDR) out of postgres.h. */
#if PG_VERSION_NUM >= 160000
#include "varatt.h"
#endif

/* PG 16 removed Abs() from c.h. */
#ifndef Abs
#define Abs(x) ((x) >= 0 ? (x) : -(x))
#endif

/* PG 15 renamed EmitWarningsOnPlaceholders and made it reserve the prefix. */
#if PG_VERSION_NUM < 150000
#define MarkGUCPrefixReserved(prefix) EmitWarningsOnPlaceholders(prefix)
#endif

/* PG 15 added shmem_request_hook; before it, space is requested in _PG_init. */
#if PG_VERSION_NUM >= 150000
#define IDEM_HAVE_SHMEM_REQUEST_HOOK 1
#endif

/* PG 14 moved the wait events out of pgstat.h. */
#if PG_VERSION_NUM >= 140000
#include "utils/wait_event.h"
#else
#include "pgstat.h"
#endif

/* Minor releases before 13.12, 14.9 and 15.4 lack this marker of a half-dropped database. */
#ifndef DATCONNLIMIT_INVALID_DB
#define DATCONNLIMIT_INVALID_DB -2
#endif

/* PG 14 named the string-key flag of hash_create (before it, the default) and pg_monitor's OID. */
#if PG_VERSION_NUM < 140000
#define HASH_STRINGS 0
#define ROLE_PG_MONITOR DEFAULT_ROLE_MONITOR
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

/* PG 14 added index_insert's indexUnchanged hint. */
#if PG_VERSION_NUM < 140000
#define index_insert(index, values, isnull, tid, heap, check, unchanged, info) \
	index_insert(index, values, isnull, tid, heap, check, info)
#endif

#endif							/* IDEMPOTENCY_COMPAT_H */
