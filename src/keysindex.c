/*-------------------------------------------------------------------------
 * keysindex.c
 *	  A relation that holds records, open with all its indexes for an
 *	  executor-free write (keyswrite.c): whether that write does exactly
 *	  what INSERT and UPDATE would, which indexes are its arbiters, and the
 *	  entries it makes in every index.
 *
 * The direct writes are taken only on a table where they do exactly what
 * INSERT and UPDATE would (writes_are_plain, decided once per relcache
 * build): when a DBA adds a trigger, a foreign key, a rule, a policy, a
 * CHECK constraint, a default or NOT NULL column, or a unique index other
 * than the key indexes, or attaches the table as a partition, they go
 * through the executor instead (keys.c's plans of the same writes), slower
 * but with every rule applied.  Indexes, expression and partial ones
 * included, any number of them, are maintained here as the executor
 * maintains them.
 *
 * A direct write on such a table runs code other than PostgreSQL's own
 * only through its access method and its indexes: an access method, an
 * operator class or an expression of a DBA's.  When every index runs
 * built-in code only (and the extension's own C function, in the reaper's
 * index), nothing the write runs looks up a name, and it needs no
 * restricted search_path (owner.c): a fresh claim and its complete then
 * skip the GUC nest level that costs them more than a tenth of their
 * instructions on PostgreSQL 15.  Every other write restricts the
 * search_path first, and so does building an index's IndexInfo (its
 * expressions are planned then, and a SQL function in them inlined).
 *
 * Every key index (keysrel.c: unique on exactly key, scope and owner, in
 * any order) is an arbiter: the primary key, a unique constraint that
 * replaced it, REINDEX CONCURRENTLY's new index while it is built and its
 * old one until it is dropped.  A concurrent claim's record in any of them
 * sends the claim round again, never a 23505.  PostgreSQL's ON CONFLICT
 * (key, scope, owner) takes only valid indexes as arbiters and checks the
 * others as it checks any unique index, failing with 23505 in that race:
 * the executor's insert names no arbiter when key indexes are the only
 * unique indexes.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/amapi.h"
#include "access/genam.h"
#include "access/table.h"
#include "access/transam.h"
#include "catalog/index.h"
#include "catalog/pg_language.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "executor/executor.h"
#include "nodes/nodeFuncs.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"

#include "compat.h"
#include "keysindex.h"
#include "keysrel.h"

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

/* Marks the cached IndexInfo stale when a relcache entry goes. */
static void
index_infos_invalidate(Datum arg, Oid relid)
{
	index_infos_stale = true;
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
		CacheRegisterRelcacheCallback(index_infos_invalidate, (Datum) 0);
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

/* Returns the column of attribute attnum of a table whose columns are att; -1 for a DBA's. */
static int
column_of(const AttrNumber *att, AttrNumber attnum)
{
	for (int i = 0; i < IDEM_NUM_COLS; i++)
		if (att[i] == attnum)
			return i;
	return -1;
}

/*
 * Tells whether the direct writes do on w's table, whose columns are att,
 * exactly what INSERT and UPDATE would: nothing runs there that they skip
 * (a trigger, foreign keys' included, a rule, a policy, a CHECK
 * constraint), no column gets a value they do not give it (a default, an
 * identity, a generated column, a domain's check on a DBA's column) or
 * refuses the NULL they leave, and no index decides what they do not (a
 * unique index other than a key index, whose violation is an error, not a
 * claim's conflict; an exclusion constraint; a deferred unique index), and
 * the table is not a partition (whose constraint INSERT and UPDATE check).
 * Otherwise a write takes the executor (keys.c's plans).
 */
static bool
writes_are_plain(const IdemWriteRel *w, const AttrNumber *att)
{
	Relation	rel = w->rel;
	TupleDesc	desc = RelationGetDescr(rel);

	if (rel->rd_rel->relrowsecurity || rel->trigdesc != NULL || rel->rd_rules != NULL ||
		rel->rd_rel->relispartition || (desc->constr != NULL && desc->constr->num_check > 0))
		return false;
	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);
		int			col = column_of(att, attr->attnum);

		if (attr->attisdropped)
			continue;
		if (attr->atthasdef || attr->attidentity || attr->attgenerated ||
			(attr->attnotnull && (col < 0 || !(ALWAYS_SET_COLUMNS & (1 << col)))) ||
			(col < 0 && get_typtype(attr->atttypid) == TYPTYPE_DOMAIN))
			return false;
	}
	for (int i = 0; i < w->nindexes; i++)
	{
		Form_pg_index index = w->indexes[i]->rd_index;

		if ((index->indisunique && (!w->arbiter[i] || !index->indimmediate)) ||
			w->info[i]->ii_ExclusionOps != NULL)
			return false;
	}
	return true;
}

/*
 * Tells whether function funcid is neither one of PostgreSQL's internal
 * functions nor a C function in the extension's schema, whose OID is
 * *context (only a superuser makes either): code that could look up a
 * name, as a SQL function's body does, built in or not.
 */
static bool
is_foreign_function(Oid funcid, void *context)
{
	HeapTuple	tup;
	Form_pg_proc proc;
	bool		ours;

	tup = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	if (!HeapTupleIsValid(tup))
		return true;
	proc = (Form_pg_proc) GETSTRUCT(tup);
	ours = proc->prolang == INTERNALlanguageId ||
		(proc->prolang == ClanguageId && proc->pronamespace == *(Oid *) context);
	ReleaseSysCache(tup);
	return !ours;
}

/*
 * Tells whether evaluating an index expression or predicate may run code
 * other than built-in functions and the extension's own (is_foreign_function),
 * in a node of any kind but the few whose evaluation runs nothing else.
 */
static bool
expr_runs_foreign_code(Node *node, void *context)
{
	if (node == NULL)
		return false;
	if (!IsA(node, List) && !IsA(node, Var) && !IsA(node, Const) && !IsA(node, FuncExpr) &&
		!IsA(node, OpExpr) && !IsA(node, RelabelType) && !IsA(node, BoolExpr) &&
		!IsA(node, NullTest))
		return true;
	if (check_functions_in_node(node, is_foreign_function, context))
		return true;
	return expression_tree_walker(node, expr_runs_foreign_code, context);
}

/*
 * Tells whether an insert into index, described by info, runs only
 * built-in code and the extension's own: its access method, its operator
 * families and support functions, its expressions and predicate.
 */
static bool
index_runs_own_code(Relation index, IndexInfo *info, Oid nsp)
{
	int			nsupport = index->rd_indam->amsupport;

	if (index->rd_rel->relam >= FirstNormalObjectId)
		return false;
	for (int i = 0; i < IndexRelationGetNumberOfKeyAttributes(index); i++)
	{
		if (index->rd_opfamily[i] >= FirstNormalObjectId)
			return false;
		for (int j = 0; j < nsupport; j++)
			if (index->rd_support[i * nsupport + j] >= FirstNormalObjectId)
				return false;
	}
	return !expr_runs_foreign_code((Node *) info->ii_Expressions, &nsp) &&
		!expr_runs_foreign_code((Node *) info->ii_Predicate, &nsp);
}

/*
 * Tells whether a direct write on w's table, in the extension's schema nsp,
 * runs only built-in code: a built-in table access method, and indexes
 * that do (index_runs_own_code).
 */
static bool
writes_run_own_code(const IdemWriteRel *w, Oid nsp)
{
	if (w->rel->rd_rel->relam >= FirstNormalObjectId)
		return false;
	for (int i = 0; i < w->nindexes; i++)
		if (!index_runs_own_code(w->indexes[i], w->info[i], nsp))
			return false;
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

/*
 * Returns the IndexInfo of an index of the call's table of records, cached
 * per backend; building one restricts the call's search_path first.
 */
static IndexInfo *
cached_index_info(IdemCall *call, Relation index)
{
	MemoryContext old;
	IndexInfo  *info;

	for (int i = 0; i < index_info_count; i++)
		if (index_info_oid[i] == RelationGetRelid(index))
			return index_info[i];
	idem_call_restrict(call);
	old = MemoryContextSwitchTo(index_info_cxt);
	info = BuildIndexInfo(index);
	MemoryContextSwitchTo(old);
	index_info_oid[index_info_count] = RelationGetRelid(index);
	index_info[index_info_count++] = info;
	return info;
}

/*
 * Marks the arbiters among w's indexes, whose table's facts are f: its key
 * indexes, where a claim's insert finds a concurrent record of its key.
 * The key index the facts found is one without a look at the catalogs; only
 * another unique index (a copy that REINDEX CONCURRENTLY builds) is looked
 * at, as it is rare.
 */
static void
find_arbiters(IdemWriteRel *w, const IdemRelFacts *f)
{
	w->only_arbiters = true;
	for (int i = 0; i < w->nindexes; i++)
	{
		Relation	index = w->indexes[i];

		w->arbiter[i] = RelationGetRelid(index) == f->key_index ||
			(index->rd_index->indisunique && idem_is_key_index(w->rel, index, f->att));
		if ((index->rd_index->indisunique || w->info[i]->ii_ExclusionOps != NULL) &&
			!w->arbiter[i])
			w->only_arbiters = false;
	}
}

/*
 * Opens the call's table and all its indexes for a write (locks kept to the
 * end of the transaction), and tells whether the direct write may be taken;
 * restricts the call's search_path unless it runs built-in code only;
 * raises 55000 when the table has no key index (keysrel.c).
 */
void
idem_write_rel_open(IdemCall *call, IdemWriteRel *w)
{
	List	   *oids;
	ListCell   *lc;
	IdemRelFacts *f;

	w->rel = table_open(call->rel.relid, RowExclusiveLock);
	oids = RelationGetIndexList(w->rel);
	w->indexes = palloc(Max(list_length(oids), 1) * sizeof(Relation));
	w->info = palloc(Max(list_length(oids), 1) * sizeof(IndexInfo *));
	w->arbiter = palloc(Max(list_length(oids), 1) * sizeof(bool));
	w->nindexes = 0;
	foreach(lc, oids)
		w->indexes[w->nindexes++] = index_open(lfirst_oid(lc), RowExclusiveLock);
	list_free(oids);
	/* Opening the indexes read the invalidations: only now can the cache be emptied. */
	make_room_for_index_infos(w->nindexes);
	for (int i = 0; i < w->nindexes; i++)
		w->info[i] = cached_index_info(call, w->indexes[i]);
	f = idem_rel_facts(call, w->rel);
	idem_require_key_index(call, f);
	find_arbiters(w, f);
	if (f->direct < 0)
	{
		f->direct = writes_are_plain(w, f->att);
		f->direct_own_code = f->direct && writes_run_own_code(w, idem_keys_catalog()->namespace);
	}
	w->direct = f->direct;
	if (!f->direct_own_code)
		idem_call_restrict(call);
}

/* Closes what idem_write_rel_open opened, keeping the locks. */
void
idem_write_rel_close(IdemWriteRel *w)
{
	for (int i = 0; i < w->nindexes; i++)
		index_close(w->indexes[i], NoLock);
	table_close(w->rel, NoLock);
	pfree(w->indexes);
	pfree(w->info);
	pfree(w->arbiter);
}

/*
 * Inserts the index entries of the tuple in slot, the arbiters' first (the
 * key indexes), into every index ready for inserts (one
 * being built concurrently may not be yet); with summarizing_only, into the
 * summarizing ones only (a HOT update, from PostgreSQL 16).
 * With speculative, the arbiters are checked partially, without waiting, as
 * INSERT ... ON CONFLICT checks its arbiters: returns false, having
 * inserted nothing else, when another record of its key exists (committed
 * or not).  Otherwise a duplicate is an error.
 */
bool
idem_insert_index_entries(IdemWriteRel *w, TupleTableSlot *slot, bool speculative,
						  bool summarizing_only)
{
	for (int pass = 0; pass < 2; pass++)
	{
		for (int i = 0; i < w->nindexes; i++)
		{
			Relation	index = w->indexes[i];
			Datum		values[INDEX_MAX_KEYS];
			bool		isnull[INDEX_MAX_KEYS];
			IndexUniqueCheck check;

			if (w->arbiter[i] != (pass == 0) || !w->info[i]->ii_ReadyForInserts ||
				(summarizing_only && !IDEM_INDEX_SUMMARIZING(w->info[i])))
				continue;
			check = !index->rd_index->indisunique ? UNIQUE_CHECK_NO :
				speculative && w->arbiter[i] ? UNIQUE_CHECK_PARTIAL : UNIQUE_CHECK_YES;
			if (!form_index_entry(w->info[i], slot, values, isnull))
				continue;
			if (!index_insert(index, values, isnull, &slot->tts_tid, w->rel, check,
							  false, w->info[i]) &&
				check == UNIQUE_CHECK_PARTIAL)
				return false;
		}
	}
	return true;
}

