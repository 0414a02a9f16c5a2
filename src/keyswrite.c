/*-------------------------------------------------------------------------
 * keyswrite.c
 *	  Claim's insert of a new record and complete's update of it, without
 *	  the executor, on the call's relation: the table itself, or with Citus
 *	  the scope's local shard (citus.c).
 *
 * A fresh claim and its complete are most of the API's work; through SPI
 * each paid an executor start-up, and the insert an extra descent of the
 * key index for ON CONFLICT's pre-check.  Here they use the table and index
 * access methods directly, as PostgreSQL's own INSERT ... ON CONFLICT and
 * UPDATE do underneath, on a table where that is exactly what INSERT and
 * UPDATE would do (keysindex.c); elsewhere through keys.c's plans:
 *
 * - the insert is a speculative insertion: the heap tuple is inserted with
 *   a speculative token, then the key indexes' entries with a partial
 *   unique check; on a possible conflict (another transaction's record of
 *   the same (scope, key, owner), committed or not) the tuple is killed and
 *   the claim reads again, after waiting for that transaction.  So a
 *   concurrent claim never gets a second `new`, exactly as with ON CONFLICT.
 * - the update finds the claim's row under a fresh snapshot and updates it
 *   with table_tuple_update.  It looks first where this backend's latest
 *   claim inserted the row, if that claim's fence is the one completing:
 *   most completes follow their claim in the same backend, and the look
 *   saves a descent of the key index; keysread.c accepts only the very row
 *   version, visible and byte for byte of that scope, key and fence, and
 *   otherwise scans the key index.  table_tuple_update waits for a
 *   concurrent writer of the row; if that writer changed it, READ COMMITTED
 *   reads the row again through the key index and re-checks the fence (as
 *   EvalPlanQual would), and REPEATABLE READ fails with 40001, as an UPDATE
 *   would.  From 1.6 it is a HOT update again where the page has room: no
 *   index reads a column it changes (1.3 to 1.5 had an index of the records
 *   in progress, which made it write every index; gauges.c keeps the
 *   figures that index gave idempotency.stats).
 *
 * Everything else (reset, takeover, release, extend, checkpoint, lookup,
 * reap) stays in SPI plans (keys.c): they are rare, or bulk.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "storage/lmgr.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "args.h"
#include "compat.h"
#include "fence.h"
#include "gauges.h"
#include "keysindex.h"
#include "keysread.h"
#include "keysrel.h"
#include "keyswrite.h"

/*
 * Where this backend's latest new claim put its row: complete looks there
 * before it scans the key index (keysread.c checks what it finds).
 */
static struct
{
	Oid			relid;
	int64		fence;
	ItemPointerData tid;
}			last_insert;

/*
 * Inserts a new claim of (scope, key) owned by the caller, with a new fence
 * and token (NULL: none); returns false when a record of (scope, key,
 * caller) exists already, from a committed transaction or one still writing
 * (the caller reads again, after waiting for it).
 */
bool
idem_keys_insert(IdemCall *call, text *key, bytea *fingerprint, Interval *lease,
				 Interval *retention, const pg_uuid_t *token, TimestampTz now, int64 *fence)
{
	const IdemKeysCatalog *c = idem_keys_catalog();
	const AttrNumber *att = call->rel.att;
	IdemWriteRel w;
	TupleDesc	desc;
	Datum	   *values;
	bool	   *nulls;
	TupleTableSlot *slot;
	uint32		spec_token;
	bool		inserted;

	idem_write_rel_open(call, &w);
	if (!w.direct)
	{
		bool		only_arbiters = w.only_arbiters;

		idem_write_rel_close(&w);
		return idem_keys_insert_sql(call, key, fingerprint, lease, now,
									idem_interval_end(now, retention),
									idem_interval_end(now, lease), token, only_arbiters,
									fence);
	}
	desc = RelationGetDescr(w.rel);
	values = palloc0(desc->natts * sizeof(Datum));
	nulls = palloc(desc->natts * sizeof(bool));
	memset(nulls, true, desc->natts * sizeof(bool));
#define SET_COL(col, value) (values[att[col] - 1] = (value), nulls[att[col] - 1] = false)
	*fence = idem_keys_next_fence(0);
	SET_COL(IDEM_COL_FENCE, Int64GetDatum(*fence));
	SET_COL(IDEM_COL_CREATED_AT, TimestampTzGetDatum(now));
	SET_COL(IDEM_COL_EXPIRES_AT, TimestampTzGetDatum(idem_interval_end(now, retention)));
	SET_COL(IDEM_COL_LEASE_EXPIRES_AT, TimestampTzGetDatum(idem_interval_end(now, lease)));
	SET_COL(IDEM_COL_LEASE, IntervalPGetDatum(lease));
	SET_COL(IDEM_COL_ATTEMPT, Int32GetDatum(1));
	SET_COL(IDEM_COL_STATE, ObjectIdGetDatum(c->in_progress_label));
	SET_COL(IDEM_COL_OWNER, ObjectIdGetDatum(call->caller));
	SET_COL(IDEM_COL_SCOPE, call->scope);
	SET_COL(IDEM_COL_KEY, PointerGetDatum(key));
	SET_COL(IDEM_COL_FINGERPRINT, PointerGetDatum(fingerprint));
	if (token && IDEM_HAS_TOKEN(&call->rel))
		SET_COL(IDEM_COL_TOKEN, UUIDPGetDatum(token));
#undef SET_COL

	slot = MakeSingleTupleTableSlot(desc, &TTSOpsHeapTuple);
	ExecStoreHeapTuple(heap_form_tuple(desc, values, nulls), slot, true);
	spec_token = SpeculativeInsertionLockAcquire(GetCurrentTransactionId());
	table_tuple_insert_speculative(w.rel, slot, GetCurrentCommandId(true), 0, NULL, spec_token);
	inserted = idem_insert_index_entries(&w, slot, true, false);
	table_tuple_complete_speculative(w.rel, slot, spec_token, inserted);
	SpeculativeInsertionLockRelease(GetCurrentTransactionId());

	if (inserted)
	{
		last_insert.relid = RelationGetRelid(w.rel);
		last_insert.fence = *fence;
		last_insert.tid = slot->tts_tid;
		idem_gauges_claimed(call->rel.relid, *fence, idem_interval_end(now, lease));
	}
	ExecDropSingleTupleTableSlot(slot);
	idem_write_rel_close(&w);
	/* Later reads of this transaction see the new record. */
	CommandCounterIncrement();
	return inserted;
}

/*
 * Stores the response if this fence owns the claim and the caller sees it:
 * the record becomes completed; returns whether it did.
 */
bool
idem_keys_complete(IdemCall *call, text *key, int64 fence, int32 status_code,
				   Jsonb *headers, bytea *body, TimestampTz now)
{
	const IdemKeysCatalog *c = idem_keys_catalog();
	const AttrNumber *att = call->rel.att;
	IdemWriteRel w;
	TupleDesc	desc;
	TupleTableSlot *old_slot;
	TupleTableSlot *new_slot;
	Datum	   *values;
	bool	   *nulls;
	bool	   *replace;
	bool		done = false;
	ItemPointer hint = NULL;

	idem_write_rel_open(call, &w);
	if (!w.direct)
	{
		idem_write_rel_close(&w);
		return idem_keys_complete_sql(call, key, fence, status_code, headers, body, now);
	}
	/* As an UPDATE: refused when a publication needs a replica identity the table lacks. */
	CheckCmdReplicaIdentity(w.rel, CMD_UPDATE);
	desc = RelationGetDescr(w.rel);
	old_slot = table_slot_create(w.rel, NULL);
	new_slot = MakeSingleTupleTableSlot(desc, &TTSOpsHeapTuple);
	values = palloc0(desc->natts * sizeof(Datum));
	nulls = palloc0(desc->natts * sizeof(bool));
	replace = palloc0(desc->natts * sizeof(bool));
#define SET_COL(col, value, isnull) \
	(values[att[col] - 1] = (value), nulls[att[col] - 1] = (isnull), replace[att[col] - 1] = true)
	SET_COL(IDEM_COL_STATE, ObjectIdGetDatum(c->completed_label), false);
	SET_COL(IDEM_COL_STATUS_CODE, Int32GetDatum(status_code), false);
	SET_COL(IDEM_COL_HEADERS, PointerGetDatum(headers), headers == NULL);
	SET_COL(IDEM_COL_BODY, PointerGetDatum(body), body == NULL);
	SET_COL(IDEM_COL_COMPLETED_AT, TimestampTzGetDatum(now), false);
	SET_COL(IDEM_COL_LEASE_EXPIRES_AT, (Datum) 0, true);
	SET_COL(IDEM_COL_LEASE, (Datum) 0, true);
	if (IDEM_HAS_TOKEN(&call->rel))
		SET_COL(IDEM_COL_TOKEN, (Datum) 0, true);
#undef SET_COL
	if (last_insert.relid == RelationGetRelid(w.rel) && last_insert.fence == fence)
		hint = &last_insert.tid;

	for (;;)
	{
		Snapshot	snapshot = RegisterSnapshot(GetTransactionSnapshot());
		TM_FailureData tmfd;
		LockTupleMode lockmode;
		IdemUpdateIndexes update_indexes;
		TM_Result	result;
		HeapTuple	old_tuple;
		bool		should_free;
		bool		found;

		found = idem_keys_find_claim(call, w.rel, snapshot, key, fence, now, hint, old_slot);
		/* A retry after a concurrent update reads the key index. */
		hint = NULL;
		if (!found)
		{
			UnregisterSnapshot(snapshot);
			break;
		}
		old_tuple = ExecFetchSlotHeapTuple(old_slot, false, &should_free);
		ExecStoreHeapTuple(heap_modify_tuple(old_tuple, desc, values, nulls, replace),
						   new_slot, true);
		result = table_tuple_update(w.rel, &old_slot->tts_tid, new_slot,
									GetCurrentCommandId(true), snapshot, InvalidSnapshot,
									true, &tmfd, &lockmode, &update_indexes);
		UnregisterSnapshot(snapshot);
		if (result == TM_Ok)
		{
			if (IDEM_UPDATE_INDEXES_NEEDED(update_indexes))
				(void) idem_insert_index_entries(&w, new_slot, false,
												 IDEM_UPDATE_SUMMARIZING_ONLY(update_indexes));
			done = true;
			break;
		}
		if (result == TM_SelfModified)
			break;				/* an earlier call of this transaction changed it */
		if (result != TM_Updated && result != TM_Deleted)
			elog(ERROR, "unexpected table_tuple_update status: %u", result);
		/* A concurrent transaction changed the row, and committed. */
		if (IsolationUsesXactSnapshot())
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to concurrent update")));
		/* READ COMMITTED: read it again, and check the fence again. */
	}

	ExecDropSingleTupleTableSlot(new_slot);
	ExecDropSingleTupleTableSlot(old_slot);
	idem_write_rel_close(&w);
	if (done)
		idem_gauges_ended(call->rel.relid, fence);
	CommandCounterIncrement();
	return done;
}
