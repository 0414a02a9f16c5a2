/*-------------------------------------------------------------------------
 * keysheap.c
 *	  The hot paths to idempotency.keys, without the executor: claim's read
 *	  of a record, its insert of a new claim, and complete's update.  Each
 *	  works on the call's relation: the table itself, or with Citus the
 *	  scope's local shard (citus.c).
 *
 * A fresh claim and its complete are most of the API's work; through SPI
 * each paid an executor start-up, and the insert an extra descent of the
 * primary key for ON CONFLICT's pre-check.  Here they use the table and
 * index access methods directly, as PostgreSQL's own INSERT ... ON CONFLICT
 * and UPDATE do underneath:
 *
 * - the insert is a speculative insertion: the heap tuple is inserted with
 *   a speculative token, then the primary key entry with a partial unique
 *   check; on a possible conflict (another transaction's record of the same
 *   (scope, key, owner), committed or not) the tuple is killed and the
 *   claim reads again, after waiting for that transaction.  So a concurrent
 *   claim never gets a second `new`, exactly as with ON CONFLICT.
 * - the update finds the claim's row under a fresh snapshot and updates it
 *   with table_tuple_update, which waits for a concurrent writer of the row;
 *   if that writer changed it, READ COMMITTED reads the row again and
 *   re-checks the fence (as EvalPlanQual would), and REPEATABLE READ fails
 *   with 40001, as an UPDATE would.  It is HOT whenever the page has room,
 *   as complete changes no indexed column.
 *
 * Everything else (reset, takeover, release, extend, checkpoint, lookup,
 * reap) stays in SPI plans (keys.c): they are rare, or bulk.
 *
 * The two direct writes are taken only on a table where they do exactly
 * what INSERT and UPDATE would (writes_are_plain, decided once per relcache
 * build): when a DBA adds a trigger, a foreign key, a rule, a policy, a
 * CHECK constraint, a default or NOT NULL column, or a unique index other
 * than the primary key and its copies, or attaches the table as a
 * partition, they go through the executor instead (keys.c's plans of the
 * same writes), slower but with every rule applied.  Indexes, expression
 * and partial ones included, any number of them, are maintained here as
 * the executor maintains them.  The columns' types are checked (catalog.c):
 * a changed type makes the API refuse, never store a wrong value.
 *
 * A copy of the primary key (REINDEX CONCURRENTLY's new index while it is
 * built, its old one until it is dropped) is an arbiter like the primary
 * key: a concurrent claim's record there sends the claim round again, as
 * in the primary key.  PostgreSQL's ON CONFLICT (key, scope, owner) takes
 * only valid indexes as arbiters and checks the others as it checks any
 * unique index, failing with 23505 in that race: the executor's insert
 * names no arbiter when the copies are the only other unique indexes.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/pg_type.h"
#include "catalog/pg_collation.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/memutils.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/rls.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "args.h"
#include "compat.h"
#include "fence.h"
#include "keys.h"
#include "keysheap.h"

/* The table and all its indexes (as many as it has), open for one write. */
typedef struct KeysRel
{
	Relation	rel;
	int			nindexes;
	Relation   *indexes;
	IndexInfo **info;
	bool	   *arbiter;		/* the primary key, or a copy of it (is_key_copy) */
	bool		only_arbiters;	/* no unique or exclusion index but those */
	bool		direct;			/* the direct write does what the executor would */
} KeysRel;

/*
 * What a relation that holds records is, decided once per relcache build
 * of it: its column numbers (described, so their types checked, by catalog.c)
 * and whether the direct writes may be taken on it (-1: not decided yet).
 * Entries of a relation are forgotten in the invalidation callback: they
 * hold no pointers, and are read only once the relation and its indexes are
 * open, after the invalidations that opening them read.
 */
typedef struct RelFacts
{
	Oid			relid;
	AttrNumber	att[IDEM_NUM_COLS];
	Oid			scope_type;		/* the scope column's type and collation */
	Oid			scope_collation;
	int			direct;
} RelFacts;

#define MAX_REL_FACTS 64

static RelFacts rel_facts[MAX_REL_FACTS];
static int	rel_facts_count = 0;

/* The columns that every direct write leaves not null: the only ones a NOT NULL may be on. */
#define ALWAYS_SET_COLUMNS \
	((1 << IDEM_COL_FENCE) | (1 << IDEM_COL_CREATED_AT) | (1 << IDEM_COL_EXPIRES_AT) | \
	 (1 << IDEM_COL_ATTEMPT) | (1 << IDEM_COL_STATE) | (1 << IDEM_COL_OWNER) | \
	 (1 << IDEM_COL_SCOPE) | (1 << IDEM_COL_KEY) | (1 << IDEM_COL_FINGERPRINT))

/*
 * IndexInfo of the indexes of the tables that hold records (idempotency.keys,
 * or with Citus each local shard of it), built once per backend (as the
 * executor builds them once per statement) and forgotten after any relcache
 * invalidation, or when the cache is full.  Forgotten at the start of a
 * write, not in the invalidation callback: a write that is opening its
 * indexes reads invalidations, and holds the IndexInfo of those it opened
 * already.  A short array: without Citus it holds two.
 */
#define MAX_CACHED_INDEX_INFOS 64

static MemoryContext index_info_cxt = NULL;
static EState *index_estate = NULL;
static Oid *index_info_oid = NULL;
static IndexInfo **index_info = NULL;
static int	index_info_count = 0;
static int	index_info_room = 0;	/* entries allocated: at least one write's */
static bool index_infos_stale = false;

/*
 * Marks the cached IndexInfo stale, and forgets the facts of relation relid
 * (all of them for InvalidOid), when a relcache entry goes.  Facts are
 * marked, not moved: a write deciding on an entry may read invalidations
 * meanwhile, and then decides for none.
 */
static void
relcache_invalidate(Datum arg, Oid relid)
{
	index_infos_stale = true;
	if (!OidIsValid(relid))
		rel_facts_count = 0;
	for (int i = 0; i < rel_facts_count; i++)
		if (rel_facts[i].relid == relid)
			rel_facts[i].relid = InvalidOid;
}

/* Registers relcache_invalidate, once (PostgreSQL has few slots for such callbacks). */
static void
register_invalidation(void)
{
	static bool registered = false;

	if (!registered)
		CacheRegisterRelcacheCallback(relcache_invalidate, (Datum) 0);
	registered = true;
}

/*
 * Empties the cache if an invalidation made it stale or it has no room for
 * n more, making room for at least n (a table has no limit on indexes: a
 * REINDEX CONCURRENTLY doubles them while it runs); none of it may be in use.
 */
static void
make_room_for_index_infos(int n)
{
	if (index_info_cxt == NULL)
	{
		index_info_cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency index info",
											   ALLOCSET_SMALL_SIZES);
		register_invalidation();
	}
	if (!index_infos_stale && index_info_count + n <= index_info_room)
		return;
	MemoryContextReset(index_info_cxt);
	index_estate = NULL;		/* it lived in index_info_cxt */
	index_info_count = 0;
	index_infos_stale = false;
	index_info_room = Max(MAX_CACHED_INDEX_INFOS, n);
	index_info_oid = MemoryContextAlloc(index_info_cxt, index_info_room * sizeof(Oid));
	index_info = MemoryContextAlloc(index_info_cxt, index_info_room * sizeof(IndexInfo *));
}

/*
 * Returns the facts of rel, the call's relation, open with its indexes;
 * raises 42804 when a column's type changed (catalog.c), and 40001 when its
 * columns moved, or its scope column took another type or collation, since
 * the call described it (within a transaction that had not yet seen the
 * change): the call's scope value is of the type it described.
 */
static RelFacts *
facts_of(const IdemCall *call, Relation rel)
{
	RelFacts   *f = NULL;

	for (int i = 0; i < rel_facts_count && f == NULL; i++)
		if (rel_facts[i].relid == RelationGetRelid(rel))
			f = &rel_facts[i];
	if (f == NULL)
	{
		IdemKeysRel described;

		register_invalidation();
		idem_keys_rel_describe(rel, &described);
		if (rel_facts_count == MAX_REL_FACTS)
			rel_facts_count = 0;
		f = &rel_facts[rel_facts_count++];
		f->relid = RelationGetRelid(rel);
		memcpy(f->att, described.att, sizeof(f->att));
		f->scope_type = described.scope.type;
		f->scope_collation = described.scope.collation;
		f->direct = -1;
	}
	if (memcmp(f->att, call->rel.att, sizeof(f->att)) != 0 ||
		f->scope_type != call->rel.scope.type || f->scope_collation != call->rel.scope.collation)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("the columns of %s changed during the transaction", call->rel.name),
				 errhint("Retry the transaction.")));
	return f;
}

/* Returns the column of rel's attribute attnum, or -1 for a column of the DBA's. */
static int
column_of(const RelFacts *f, AttrNumber attnum)
{
	for (int i = 0; i < IDEM_NUM_COLS; i++)
		if (f->att[i] == attnum)
			return i;
	return -1;
}

/*
 * Tells whether index is a copy of the primary key pk: unique, immediate,
 * whole (no expression, no predicate), on the same columns with the same
 * access method, operator classes, collations and options.  REINDEX
 * CONCURRENTLY makes one, ready for inserts before it is valid, and keeps
 * the old one, no longer valid, until it drops it; a DBA may make one.  A
 * conflict in a copy is a conflict of the same (scope, key, owner): a
 * claim's race, decided there as in the primary key, never a 23505.
 */
static bool
is_key_copy(Relation index, const IndexInfo *info, Relation pk)
{
	Form_pg_index form = index->rd_index;
	Form_pg_index pkform = pk->rd_index;

	if (!form->indisunique || !form->indimmediate || info->ii_Expressions != NIL ||
		info->ii_Predicate != NIL || index->rd_rel->relam != pk->rd_rel->relam ||
		form->indnatts != pkform->indnatts || form->indnkeyatts != pkform->indnkeyatts)
		return false;
	for (int i = 0; i < form->indnatts; i++)
		if (form->indkey.values[i] != pkform->indkey.values[i])
			return false;
	for (int i = 0; i < form->indnkeyatts; i++)
		if (index->rd_opfamily[i] != pk->rd_opfamily[i] ||
			index->rd_opcintype[i] != pk->rd_opcintype[i] ||
			index->rd_indcollation[i] != pk->rd_indcollation[i] ||
			index->rd_indoption[i] != pk->rd_indoption[i])
			return false;
	return true;
}

/*
 * Marks the arbiters among k's indexes: the primary key and its copies,
 * where a claim's insert finds a concurrent record of its key.
 */
static void
find_arbiters(KeysRel *k)
{
	Oid			pk_oid = RelationGetPrimaryKeyIndex(k->rel);
	Relation	pk = NULL;

	for (int i = 0; i < k->nindexes; i++)
		if (RelationGetRelid(k->indexes[i]) == pk_oid)
			pk = k->indexes[i];
	k->only_arbiters = true;
	for (int i = 0; i < k->nindexes; i++)
	{
		Relation	index = k->indexes[i];

		k->arbiter[i] = pk != NULL && (index == pk || is_key_copy(index, k->info[i], pk));
		if ((index->rd_index->indisunique || k->info[i]->ii_ExclusionOps != NULL) &&
			!k->arbiter[i])
			k->only_arbiters = false;
	}
}

/*
 * Tells whether the direct writes do on k's table exactly what INSERT and
 * UPDATE would: nothing runs there that they skip (a trigger, foreign
 * keys' included, a rule, a policy, a CHECK constraint), no column gets a
 * value they do not give it (a default, an identity, a generated column, a
 * domain's check on a DBA's column) or refuses the NULL they leave, and no
 * index decides what they do not (a unique index other than the primary
 * key or a copy of it, whose violation is an error, not a claim's conflict;
 * an exclusion constraint; a deferred primary key), and the table is not a
 * partition (whose constraint INSERT and UPDATE check).  Otherwise a write
 * takes the executor (keys.c's plans).
 */
static bool
writes_are_plain(const KeysRel *k, const RelFacts *f)
{
	Relation	rel = k->rel;
	TupleDesc	desc = RelationGetDescr(rel);

	if (rel->rd_rel->relrowsecurity || rel->trigdesc != NULL || rel->rd_rules != NULL ||
		rel->rd_rel->relispartition || (desc->constr != NULL && desc->constr->num_check > 0))
		return false;
	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);
		int			col = column_of(f, attr->attnum);

		if (attr->attisdropped)
			continue;
		if (attr->atthasdef || attr->attidentity || attr->attgenerated ||
			(attr->attnotnull && (col < 0 || !(ALWAYS_SET_COLUMNS & (1 << col)))) ||
			(col < 0 && get_typtype(attr->atttypid) == TYPTYPE_DOMAIN))
			return false;
	}
	for (int i = 0; i < k->nindexes; i++)
	{
		Form_pg_index index = k->indexes[i]->rd_index;

		if ((index->indisunique && (!k->arbiter[i] || !index->indimmediate)) ||
			k->info[i]->ii_ExclusionOps != NULL)
			return false;
	}
	return true;
}

/*
 * Returns the expression context in which the expressions and predicates of
 * an expression or partial index on the table are evaluated, with slot as
 * the row.  Its executor state lives as long as the cached IndexInfo, which
 * keep their prepared expressions (as the executor keeps them for a
 * statement).
 */
static ExprContext *
index_expr_context(TupleTableSlot *slot)
{
	ExprContext *econtext;

	if (index_estate == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(index_info_cxt);

		index_estate = CreateExecutorState();
		MemoryContextSwitchTo(old);
	}
	econtext = GetPerTupleExprContext(index_estate);
	ResetExprContext(econtext);
	econtext->ecxt_scantuple = slot;
	return econtext;
}

/*
 * Computes the index entry of the row in slot into values and isnull, as
 * the executor's ExecInsertIndexTuples does, expressions included; returns
 * false when the row does not belong in the index (a partial index whose
 * predicate it fails).
 */
static bool
form_index_entry(IndexInfo *info, TupleTableSlot *slot, Datum *values, bool *isnull)
{
	EState	   *estate = NULL;

	if (info->ii_Expressions != NIL || info->ii_Predicate != NIL)
	{
		ExprContext *econtext = index_expr_context(slot);

		estate = index_estate;
		if (info->ii_Predicate != NIL)
		{
			if (info->ii_PredicateState == NULL)
				info->ii_PredicateState = ExecPrepareQual(info->ii_Predicate, estate);
			if (!ExecQual(info->ii_PredicateState, econtext))
				return false;
		}
	}
	FormIndexDatum(info, slot, estate, values, isnull);
	return true;
}

/* Returns the IndexInfo of an index of a table of records, cached per backend. */
static IndexInfo *
cached_index_info(Relation index)
{
	MemoryContext old;
	IndexInfo  *info;

	for (int i = 0; i < index_info_count; i++)
		if (index_info_oid[i] == RelationGetRelid(index))
			return index_info[i];
	old = MemoryContextSwitchTo(index_info_cxt);
	info = BuildIndexInfo(index);
	MemoryContextSwitchTo(old);
	index_info_oid[index_info_count] = RelationGetRelid(index);
	index_info[index_info_count++] = info;
	return info;
}

/*
 * Opens the call's table and all its indexes for a write (locks kept to the
 * end of the transaction), and tells whether the direct write may be taken.
 */
static void
keys_open(const IdemCall *call, KeysRel *k)
{
	List	   *oids;
	ListCell   *lc;
	RelFacts   *f;

	k->rel = table_open(call->rel.relid, RowExclusiveLock);
	oids = RelationGetIndexList(k->rel);
	k->indexes = palloc(Max(list_length(oids), 1) * sizeof(Relation));
	k->info = palloc(Max(list_length(oids), 1) * sizeof(IndexInfo *));
	k->arbiter = palloc(Max(list_length(oids), 1) * sizeof(bool));
	k->nindexes = 0;
	foreach(lc, oids)
		k->indexes[k->nindexes++] = index_open(lfirst_oid(lc), RowExclusiveLock);
	list_free(oids);
	/* Opening the indexes read the invalidations: only now can the cache be emptied. */
	make_room_for_index_infos(k->nindexes);
	for (int i = 0; i < k->nindexes; i++)
		k->info[i] = cached_index_info(k->indexes[i]);
	find_arbiters(k);
	f = facts_of(call, k->rel);
	if (f->direct < 0)
		f->direct = writes_are_plain(k, f);
	k->direct = f->direct;
}

/* Closes what keys_open opened, keeping the locks. */
static void
keys_close(KeysRel *k)
{
	for (int i = 0; i < k->nindexes; i++)
		index_close(k->indexes[i], NoLock);
	table_close(k->rel, NoLock);
	pfree(k->indexes);
	pfree(k->info);
	pfree(k->arbiter);
}

/* Starts an index scan of the primary key for the records of the call's (scope, key). */
static IndexScanDesc
begin_key_scan(Relation rel, Relation pk, Snapshot snapshot, const IdemCall *call, text *key)
{
	const IdemScopeType *st = &call->rel.scope;

	ScanKeyData skey[2];
	IndexScanDesc scan;

	/* The primary key is (key, scope, owner). */
	ScanKeyEntryInitialize(&skey[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(key));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   st->collation, st->eq, call->scope);
	scan = index_beginscan(rel, pk, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	return scan;
}

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
	rec->same_fingerprint =
		VARSIZE_ANY_EXHDR(stored) == VARSIZE_ANY_EXHDR(fingerprint) &&
		memcmp(VARDATA_ANY(stored), VARDATA_ANY(fingerprint),
			   VARSIZE_ANY_EXHDR(stored)) == 0;
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
 * index lookup through the primary key with a new snapshot, as a READ
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
	Relation	pk;
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
	pk = index_open(RelationGetPrimaryKeyIndex(rel), RowExclusiveLock);
	(void) facts_of(call, rel);
	refuse_owner_rls(call, rel);
	slot = table_slot_create(rel, NULL);
	scan = begin_key_scan(rel, pk, snapshot, call, key);

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
	index_close(pk, NoLock);
	table_close(rel, NoLock);
	UnregisterSnapshot(snapshot);
	return best != NULL;
}

/*
 * Returns a transaction, other than ours, that is writing a record of
 * (scope, key) the caller sees (inserting, updating or deleting it, and not
 * yet committed: maybe prepared); InvalidTransactionId when there is none.
 * A dirty read through the primary key.
 */
TransactionId
idem_keys_writer(IdemCall *call, text *key)
{
	SnapshotData dirty;
	Relation	rel;
	Relation	pk;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	TransactionId writer = InvalidTransactionId;

	InitDirtySnapshot(dirty);
	rel = table_open(call->rel.relid, RowExclusiveLock);
	pk = index_open(RelationGetPrimaryKeyIndex(rel), RowExclusiveLock);
	slot = table_slot_create(rel, NULL);
	scan = begin_key_scan(rel, pk, &dirty, call, key);
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
	index_close(pk, NoLock);
	table_close(rel, NoLock);
	return writer;
}

/*
 * Inserts the index entries of the tuple in slot, the arbiters' first (the
 * primary key and its copies), into every index ready for inserts (one
 * being built concurrently may not be yet); with summarizing_only, into the
 * summarizing ones only (a HOT update, from PostgreSQL 16).
 * With speculative, the arbiters are checked partially, without waiting, as
 * INSERT ... ON CONFLICT checks its arbiters: returns false, having
 * inserted nothing else, when another record of its key exists (committed
 * or not).  Otherwise a duplicate is an error.
 */
static bool
insert_index_entries(KeysRel *k, TupleTableSlot *slot, bool speculative, bool summarizing_only)
{
	for (int pass = 0; pass < 2; pass++)
	{
		for (int i = 0; i < k->nindexes; i++)
		{
			Relation	index = k->indexes[i];
			Datum		values[INDEX_MAX_KEYS];
			bool		isnull[INDEX_MAX_KEYS];
			IndexUniqueCheck check;

			if (k->arbiter[i] != (pass == 0) || !k->info[i]->ii_ReadyForInserts ||
				(summarizing_only && !IDEM_INDEX_SUMMARIZING(k->info[i])))
				continue;
			check = !index->rd_index->indisunique ? UNIQUE_CHECK_NO :
				speculative && k->arbiter[i] ? UNIQUE_CHECK_PARTIAL : UNIQUE_CHECK_YES;
			if (!form_index_entry(k->info[i], slot, values, isnull))
				continue;
			if (!index_insert(index, values, isnull, &slot->tts_tid, k->rel, check,
							  false, k->info[i]) &&
				check == UNIQUE_CHECK_PARTIAL)
				return false;
		}
	}
	return true;
}

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
	KeysRel		k;
	TupleDesc	desc;
	Datum	   *values;
	bool	   *nulls;
	TupleTableSlot *slot;
	uint32		spec_token;
	bool		inserted;

	keys_open(call, &k);
	if (!k.direct)
	{
		bool		only_arbiters = k.only_arbiters;

		keys_close(&k);
		return idem_keys_insert_sql(call, key, fingerprint, lease, now,
									idem_interval_end(now, retention),
									idem_interval_end(now, lease), token, only_arbiters,
									fence);
	}
	desc = RelationGetDescr(k.rel);
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
	table_tuple_insert_speculative(k.rel, slot, GetCurrentCommandId(true), 0, NULL, spec_token);
	inserted = insert_index_entries(&k, slot, true, false);
	table_tuple_complete_speculative(k.rel, slot, spec_token, inserted);
	SpeculativeInsertionLockRelease(GetCurrentTransactionId());

	ExecDropSingleTupleTableSlot(slot);
	keys_close(&k);
	/* Later reads of this transaction see the new record. */
	CommandCounterIncrement();
	return inserted;
}

/*
 * Finds, under snapshot, the in_progress record of (scope, key) that fence
 * owns, the caller sees and that has not expired at now; copies it into
 * slot.  An expired record counts as gone, as it does for claim and reap.
 */
static bool
find_claim(KeysRel *k, Snapshot snapshot, IdemCall *call, text *key,
		   int64 fence, TimestampTz now, TupleTableSlot *slot)
{
	const IdemKeysCatalog *c = idem_keys_catalog();
	Relation	pk = index_open(RelationGetPrimaryKeyIndex(k->rel), RowExclusiveLock);
	IndexScanDesc scan = begin_key_scan(k->rel, pk, snapshot, call, key);
	bool		found = false;

	while (!found && index_getnext_slot(scan, ForwardScanDirection, slot))
		found = DatumGetInt64(slot_col(call, slot, IDEM_COL_FENCE)) == fence &&
			DatumGetObjectId(slot_col(call, slot, IDEM_COL_STATE)) == c->in_progress_label &&
			is_live_for(call, slot, now);
	if (found)
		ExecMaterializeSlot(slot);
	index_endscan(scan);
	index_close(pk, NoLock);
	return found;
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
	KeysRel		k;
	TupleDesc	desc;
	TupleTableSlot *old_slot;
	TupleTableSlot *new_slot;
	Datum	   *values;
	bool	   *nulls;
	bool	   *replace;
	bool		done = false;

	keys_open(call, &k);
	if (!k.direct)
	{
		keys_close(&k);
		return idem_keys_complete_sql(call, key, fence, status_code, headers, body, now);
	}
	/* As an UPDATE: refused when a publication needs a replica identity the table lacks. */
	CheckCmdReplicaIdentity(k.rel, CMD_UPDATE);
	desc = RelationGetDescr(k.rel);
	old_slot = table_slot_create(k.rel, NULL);
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

	for (;;)
	{
		Snapshot	snapshot = RegisterSnapshot(GetTransactionSnapshot());
		TM_FailureData tmfd;
		LockTupleMode lockmode;
		IdemUpdateIndexes update_indexes;
		TM_Result	result;
		HeapTuple	old_tuple;
		bool		should_free;

		if (!find_claim(&k, snapshot, call, key, fence, now, old_slot))
		{
			UnregisterSnapshot(snapshot);
			break;
		}
		old_tuple = ExecFetchSlotHeapTuple(old_slot, false, &should_free);
		ExecStoreHeapTuple(heap_modify_tuple(old_tuple, desc, values, nulls, replace),
						   new_slot, true);
		result = table_tuple_update(k.rel, &old_slot->tts_tid, new_slot,
									GetCurrentCommandId(true), snapshot, InvalidSnapshot,
									true, &tmfd, &lockmode, &update_indexes);
		UnregisterSnapshot(snapshot);
		if (result == TM_Ok)
		{
			if (IDEM_UPDATE_INDEXES_NEEDED(update_indexes))
				(void) insert_index_entries(&k, new_slot, false,
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
	keys_close(&k);
	CommandCounterIncrement();
	return done;
}
