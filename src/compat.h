/*-------------------------------------------------------------------------
 * compat.h
 *	  The differences between the PostgreSQL majors the extension supports
 *	  (15 to 19), kept in one place.  A shim that renames a function is a
 *	  macro of the same name: the headers that declare those functions are
 *	  included here, before the macros, so that a header included after
 *	  this file cannot meet a macro in its own declarations.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "access/genam.h"
#include "access/tableam.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/shmem.h"
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
#if PG_VERSION_NUM >= 190000
#define index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan(heap, index, snapshot, NULL, nkeys, norderbys, IDEM_INDEX_SCAN_FLAGS)
#elif PG_VERSION_NUM >= 180000
#define index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan(heap, index, snapshot, NULL, nkeys, norderbys)
#endif

/*
 * PG 19 gives an index scan the table scan's options.  The one a caller may
 * set, SO_HINT_REL_READ_ONLY, says the statement does not write the table:
 * ours find the row that claim, complete and release then write, so none.
 */
#define IDEM_INDEX_SCAN_FLAGS 0

/*
 * PG 19 added options to table_tuple_update.  The only one,
 * TABLE_UPDATE_NO_LOGICAL, is for table rewrites; our update is an
 * application's, which logical decoding (and REPACK CONCURRENTLY, which
 * replays the writes made while it copies) must see: none.
 */
#if PG_VERSION_NUM >= 190000
#define table_tuple_update(rel, otid, slot, cid, snapshot, crosscheck, wait, tmfd, lockmode, update_indexes) \
	table_tuple_update(rel, otid, slot, cid, 0, snapshot, crosscheck, wait, tmfd, lockmode, update_indexes)
#endif

/*
 * PG 19 sizes a shared hash table once (nelems); before, by an initial and
 * a maximum size, which a fixed table gives the same.
 */
#if PG_VERSION_NUM >= 190000
#define ShmemInitHash(name, init_size, max_size, infoP, hash_flags) \
	ShmemInitHash(name, max_size, infoP, hash_flags)
#endif

/*
 * PG 19 builds a jsonb value in a JsonbInState, whose result holds the value
 * once the outermost container is closed; before, in a JsonbParseState
 * stack, and the push that closes it returns the value.  idem_push_jsonb
 * returns it on both, from a state declared IdemJsonbState and set to
 * IDEM_JSONB_STATE_INIT.
 */
#if PG_VERSION_NUM >= 190000
#define IdemJsonbState JsonbInState
#define IDEM_JSONB_STATE_INIT {0}
#define idem_push_jsonb(state, seq, val) (pushJsonbValue(state, seq, val), (state)->result)
#else
#define IdemJsonbState JsonbParseState *
#define IDEM_JSONB_STATE_INIT NULL
#define idem_push_jsonb(state, seq, val) pushJsonbValue(state, seq, val)
#endif

/*
 * PG 19 marks a deliberate fall through to the next case with pg_fallthrough
 * (its builds warn about a comment); the same attribute before it.
 */
#ifndef pg_fallthrough
#if __has_attribute(fallthrough)
#define pg_fallthrough __attribute__((fallthrough))
#else
#define pg_fallthrough
#endif
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
