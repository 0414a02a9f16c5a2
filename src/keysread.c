/*-------------------------------------------------------------------------
 * keysread.c
 *	  The reads of idempotency.keys without the executor: claim's read of
 *	  the record of a (scope, key) that the caller sees, the transaction
 *	  writing it, and complete's read of the claim its fence owns.  Each
 *	  works on the call's relation: the table itself, or with Citus the
 *	  scope's local shard (citus.c).
 *
 * A claim's read is the API's hottest path (every replay is one): through
 * SPI it paid an executor start-up.  Here it is a plain scan of the key
 * index (keysrel.c) with a new snapshot, as a READ COMMITTED statement would
 * take, reading the columns by the numbers catalog.c found for their names.
 * Nearly always one record matches, the caller's own, and the scan stops
 * there; the records of other roles with the same (scope, key) are ranked
 * (record_rank) as the SPI plans' conditions would.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "executor/tuptable.h"
#include "storage/bufmgr.h"
#include "utils/acl.h"
#include "utils/rel.h"
#include "utils/rls.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

#include "compat.h"
#include "keysread.h"
#include "keysrel.h"

/* Returns a column, which may not be NULL, of the slot's tuple of the call's table. */
static Datum
slot_col(const IdemCall *call, TupleTableSlot *slot, IdemKeysColumn col)
{
	AttrNumber	attnum = call->rel.att[col];
	bool		isnull;
	Datum		value = slot_getattr(slot, attnum, &isnull);

	if (isnull)
		elog(ERROR, "unexpected null in column %d of %s", attnum, call->rel.name);
	return value;
}

/* Copies a varlena column of the slot, detoasted, into the caller's memory; NULL when NULL. */
static struct varlena *
slot_varlena(const IdemCall *call, TupleTableSlot *slot, IdemKeysColumn col)
{
	bool		isnull;
	Datum		value = slot_getattr(slot, call->rel.att[col], &isnull);

	return idem_varlena_copy(value, isnull, call->caller_cxt);
}

/* Tells whether the caller sees records of owner: its own, or a role whose privileges it has. */
static bool
sees_owner(Oid caller, Oid owner)
{
	return owner == caller || has_privs_of_role(caller, owner);
}

/*
 * Ranks a record for the caller: 0 its own live record, 1 a live one of a
 * role whose privileges it has, 2 its own expired one, 3 another's expired
 * one; -1 a record it does not see.  Claim decides on the lowest rank.
 */
static int
record_rank(const IdemCall *call, TupleTableSlot *slot, TimestampTz now)
{
	Oid			owner = DatumGetObjectId(slot_col(call, slot, IDEM_COL_OWNER));
	bool		own = (owner == call->caller);
	bool		completed;
	bool		isnull;
	Datum		lease_end;
	bool		expired;

	if (!own && !has_privs_of_role(call->caller, owner))
		return -1;
	completed = DatumGetObjectId(slot_col(call, slot, IDEM_COL_STATE)) ==
		idem_keys_catalog()->completed_label;
	lease_end = slot_getattr(slot, call->rel.att[IDEM_COL_LEASE_EXPIRES_AT], &isnull);
	expired = DatumGetTimestampTz(slot_col(call, slot, IDEM_COL_EXPIRES_AT)) <= now &&
		(completed || isnull || DatumGetTimestampTz(lease_end) <= now);
	return (expired ? 2 : 0) + (own ? 0 : 1);
}

/* Whether the caller sees the record in slot and it has not expired at now. */
static bool
is_live_for(const IdemCall *call, TupleTableSlot *slot, TimestampTz now)
{
	int			rank = record_rank(call, slot, now);

	return rank == 0 || rank == 1;
}

/* Whether two detoasted varlenas (text, bytea) hold the same bytes. */
static bool
same_bytes(const struct varlena *a, const struct varlena *b)
{
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

/*
 * Fills rec from the record in slot: the response too when claim will
 * replay it, the token, attempt and recovery point of an in-progress one
 * that has a token (so that its owner's claim can be answered again).
 */
static void
read_record(const IdemCall *call, TupleTableSlot *slot, bytea *fingerprint, IdemRecord *rec)
{
	bytea	   *stored = DatumGetByteaPP(slot_col(call, slot, IDEM_COL_FINGERPRINT));
	bool		isnull;
	Datum		lease_end = slot_getattr(slot, call->rel.att[IDEM_COL_LEASE_EXPIRES_AT], &isnull);

	rec->owner = DatumGetObjectId(slot_col(call, slot, IDEM_COL_OWNER));
	rec->fence = DatumGetInt64(slot_col(call, slot, IDEM_COL_FENCE));
	rec->completed = DatumGetObjectId(slot_col(call, slot, IDEM_COL_STATE)) ==
		idem_keys_catalog()->completed_label;
	rec->same_fingerprint = same_bytes(stored, fingerprint);
	rec->lease_expires_at = isnull ? DT_NOBEGIN : DatumGetTimestampTz(lease_end);
	rec->expires_at = DatumGetTimestampTz(slot_col(call, slot, IDEM_COL_EXPIRES_AT));
	rec->created_at = DatumGetTimestampTz(slot_col(call, slot, IDEM_COL_CREATED_AT));
	rec->has_token = false;
	rec->recovery_point = NULL;
	rec->recovery_state = NULL;
	rec->headers = NULL;
	rec->body = NULL;
	if (!rec->completed && IDEM_HAS_TOKEN(&call->rel))
	{
		Datum		token = slot_getattr(slot, call->rel.att[IDEM_COL_TOKEN], &isnull);

		if (!isnull)
		{
			rec->has_token = true;
			rec->token = *DatumGetUUIDP(token);
			rec->attempt = DatumGetInt32(slot_col(call, slot, IDEM_COL_ATTEMPT));
			rec->recovery_point = (text *) slot_varlena(call, slot, IDEM_COL_RECOVERY_POINT);
			rec->recovery_state = (Jsonb *) slot_varlena(call, slot, IDEM_COL_RECOVERY_STATE);
		}
	}
	if (rec->completed && rec->same_fingerprint)
	{
		rec->status_code = DatumGetInt32(slot_col(call, slot, IDEM_COL_STATUS_CODE));
		rec->headers = (Jsonb *) slot_varlena(call, slot, IDEM_COL_HEADERS);
		rec->body = (bytea *) slot_varlena(call, slot, IDEM_COL_BODY);
	}
}

/*
 * Raises 0A000 when row-level security applies to the table's owner, as
 * whom the call runs (FORCE ROW LEVEL SECURITY, an owner that is neither
 * superuser nor BYPASSRLS): claim's read, which does without the
 * executor, cannot apply policies, and must not read past them.
 */
static void
refuse_owner_rls(const IdemCall *call, Relation rel)
{
	if (rel->rd_rel->relrowsecurity &&
		check_enable_rls(RelationGetRelid(rel), InvalidOid, true) == RLS_ENABLED)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("row-level security of %s applies to its owner, as whom the API runs",
						call->rel.name),
				 errdetail("The API reads its records without the policies that would hide them."),
				 errhint("Use ALTER TABLE %s NO FORCE ROW LEVEL SECURITY.", call->rel.name)));
}

/*
 * Tells whether the version of a record in slot, read under the
 * transaction's snapshot (REPEATABLE READ or SERIALIZABLE), is no longer
 * the current one: a transaction that committed after the snapshot was
 * taken updated or deleted it, so that the latest snapshot no longer sees
 * it.  A writer still running has changed nothing yet.
 */
static bool
changed_since_snapshot(Relation rel, TupleTableSlot *slot)
{
	Snapshot	latest = RegisterSnapshot(GetLatestSnapshot());
	bool		visible = table_tuple_satisfies_snapshot(rel, slot, latest);

	UnregisterSnapshot(latest);
	return !visible;
}

/*
 * Reads the record of (scope, key) that the caller sees into rec (its own
 * first, live before expired at now); false when there is none.  A plain
 * index lookup through the key index (keysrel.c) with a new snapshot, as a READ
 * COMMITTED statement would take: this is the hottest read of the API, so
 * it does without the executor.  Nearly always one record matches, the
 * caller's own, and the scan stops there.  Under REPEATABLE READ or
 * SERIALIZABLE it also tells whether the record read has changed since
 * the snapshot (claim then fails rather than answer from the past).
 */
bool
idem_keys_fetch(IdemCall *call, text *key, bytea *fingerprint,
				TimestampTz now, IdemRecord *rec)
{
	Relation	rel;
	IdemKeyIndex ki;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	TupleTableSlot *best = NULL;
	int			best_rank = -1;
	bool		best_changed = false;
	Snapshot	snapshot;

	/*
	 * A new snapshot, not the statement's: a claim that lost a race must see
	 * the winner's commit, and a second claim in one statement the first's
	 * insert.
	 */
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	rel = table_open(call->rel.relid, RowExclusiveLock);
	idem_key_index_open(call, rel, &ki);
	if (!ki.builtin)
		idem_call_restrict(call);
	refuse_owner_rls(call, rel);
	slot = table_slot_create(rel, NULL);
	scan = idem_key_scan_begin(rel, &ki, snapshot, call, key);

	while (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		int			rank = record_rank(call, slot, now);

		if (rank < 0 || (best_rank >= 0 && rank >= best_rank))
			continue;
		/* Checked while the slot still holds the buffer. */
		best_changed = IsolationUsesXactSnapshot() && changed_since_snapshot(rel, slot);
		if (rank == 0)
		{
			best = slot;		/* the caller's own live record: look no further */
			break;
		}
		if (best == NULL)
			best = table_slot_create(rel, NULL);
		ExecCopySlot(best, slot);
		best_rank = rank;
	}
	if (best)
	{
		read_record(call, best, fingerprint, rec);
		rec->changed_since_snapshot = best_changed;
	}

	index_endscan(scan);
	if (best && best != slot)
		ExecDropSingleTupleTableSlot(best);
	ExecDropSingleTupleTableSlot(slot);
	index_close(ki.index, NoLock);
	table_close(rel, NoLock);
	UnregisterSnapshot(snapshot);
	return best != NULL;
}

/*
 * Returns a transaction, other than ours, that is writing a record of
 * (scope, key) the caller sees (inserting, updating or deleting it, and not
 * yet committed: maybe prepared); InvalidTransactionId when there is none.
 * A dirty read through the key index.
 */
TransactionId
idem_keys_writer(IdemCall *call, text *key)
{
	SnapshotData dirty;
	Relation	rel;
	IdemKeyIndex ki;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	TransactionId writer = InvalidTransactionId;

	InitDirtySnapshot(dirty);
	rel = table_open(call->rel.relid, RowExclusiveLock);
	idem_key_index_open(call, rel, &ki);
	if (!ki.builtin)
		idem_call_restrict(call);
	slot = table_slot_create(rel, NULL);
	scan = idem_key_scan_begin(rel, &ki, &dirty, call, key);
	while (!TransactionIdIsValid(writer) &&
		   index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		TransactionId xid = TransactionIdIsValid(dirty.xmin) ? dirty.xmin : dirty.xmax;

		if (TransactionIdIsValid(xid) && !TransactionIdIsCurrentTransactionId(xid) &&
			sees_owner(call->caller, DatumGetObjectId(slot_col(call, slot, IDEM_COL_OWNER))))
			writer = xid;
	}
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	index_close(ki.index, NoLock);
	table_close(rel, NoLock);
	return writer;
}


/* Whether the record in slot is fence's claim, in progress, seen by the caller and live at now. */
static bool
is_claim_of(const IdemCall *call, TupleTableSlot *slot, int64 fence, TimestampTz now)
{
	return DatumGetInt64(slot_col(call, slot, IDEM_COL_FENCE)) == fence &&
		DatumGetObjectId(slot_col(call, slot, IDEM_COL_STATE)) ==
		idem_keys_catalog()->in_progress_label &&
		is_live_for(call, slot, now);
}

/*
 * Looks for fence's claim of (scope, key) at tid, where this backend
 * inserted it, without a scan of the key index: it is there while no later
 * write replaced that row version.  Only a text scope and a key identical
 * to the row's, byte for byte, are accepted; anything else (a version
 * updated since, a line reused, a key equal only under the index's
 * collation) is left to the index scan, which decides as before.  Under
 * SERIALIZABLE the fetch takes the row's predicate lock, as the scan's
 * heap fetch does; complete's answer depends on that row alone.
 */
static bool
fetch_claim_at(const IdemCall *call, Relation rel, Snapshot snapshot, ItemPointer tid,
			   text *key, int64 fence, TimestampTz now, TupleTableSlot *slot)
{
	/* VACUUM may have truncated the page away in an earlier transaction. */
	if (!call->rel.scope.is_text ||
		ItemPointerGetBlockNumber(tid) >= RelationGetNumberOfBlocks(rel) ||
		!table_tuple_fetch_row_version(rel, tid, snapshot, slot))
		return false;
	if (is_claim_of(call, slot, fence, now) &&
		same_bytes(DatumGetTextPP(slot_col(call, slot, IDEM_COL_KEY)), key) &&
		same_bytes(DatumGetTextPP(slot_col(call, slot, IDEM_COL_SCOPE)),
				   DatumGetTextPP(call->scope)))
	{
		ExecMaterializeSlot(slot);
		return true;
	}
	ExecClearTuple(slot);
	return false;
}

/*
 * Finds in rel, under snapshot, the in_progress record of (scope, key) that
 * fence owns, the caller sees and that has not expired at now; copies it into
 * slot.  An expired record counts as gone, as it does for claim and reap.
 * hint, when not NULL, is where the claim's insert put it: looked at first.
 */
bool
idem_keys_find_claim(IdemCall *call, Relation rel, Snapshot snapshot, text *key,
					 int64 fence, TimestampTz now, ItemPointer hint, TupleTableSlot *slot)
{
	IdemKeyIndex ki;
	IndexScanDesc scan;
	bool		found = false;

	if (hint && fetch_claim_at(call, rel, snapshot, hint, key, fence, now, slot))
		return true;
	idem_key_index_open(call, rel, &ki);
	if (!ki.builtin)
		idem_call_restrict(call);
	scan = idem_key_scan_begin(rel, &ki, snapshot, call, key);
	while (!found && index_getnext_slot(scan, ForwardScanDirection, slot))
		found = is_claim_of(call, slot, fence, now);
	if (found)
		ExecMaterializeSlot(slot);
	index_endscan(scan);
	index_close(ki.index, NoLock);
	return found;
}

