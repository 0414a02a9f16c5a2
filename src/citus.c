/*-------------------------------------------------------------------------
 * citus.c
 *	  idempotency.keys distributed by scope with Citus: which relation holds
 *	  a scope's records on this node, the fence floor after shards arrive,
 *	  the shards the reaper visits, and the guard that keeps a NULL scope
 *	  away from Citus's function delegation and gives a constant scope the
 *	  tenant's type.
 *
 * idempotency.citus_distribute() distributes idempotency.keys by scope and
 * makes Citus run each API call on the node that holds the scope's shard
 * (docs/citus.md).  The records then live in the shard relation
 * idempotency.keys_<shardid>: idempotency.keys on a node is an empty shell.
 * Every call therefore finds the scope's shard in a per-backend map of
 * Citus's catalogs, takes the lock that Citus's own executor takes before
 * writing a shard (so that a shard move waits for the call's transaction),
 * and works on that relation directly, or raises IK002 when this node holds
 * no placement of it (a call Citus did not delegate).  Without Citus, or
 * with idempotency.keys not distributed, a call pays one cached boolean.
 *
 * Citus hashes a NULL distribution argument while planning a delegated call
 * and crashes; a create_upper_paths_hook, which sees the query after
 * defaults, constant folding, bound parameters and inlining, exactly as
 * Citus's planner then reads it, refuses a NULL scope first.  The records'
 * scope has the type and collation of the tenant column they are colocated
 * with (citus_distribute); Citus routes a call only by a value it can assign
 * to that type, which text is not for bigint, integer or uuid: the same hook
 * hands Citus the scope as an untyped literal (untyped_scope), and every
 * call reads its text as a value of that type (idem_scope_value) to find its
 * shard.
 *
 * What this rests on was tried and measured: docs/design/citus-notes.md.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/optimizer.h"
#include "optimizer/planner.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "citus.h"
#include "idempotency.h"
#include "fence.h"
#include "keys.h"

/*
 * Citus's advisory lock class for the placement metadata of colocated
 * shards (ADV_LOCKTAG_CLASS_CITUS_COLOCATED_SHARDS_METADATA): for a hash-
 * distributed table, Citus locks (shard index, colocation id) in this class,
 * in share mode before writing a shard and exclusively to move it.
 */
#define CITUS_COLOCATED_SHARDS_LOCK_CLASS 8

/*
 * The shards of idempotency.keys, their hash ranges, whether this node holds
 * them, and the distribution column (a Var, as Citus writes it).
 */
#define SHARDS_SQL \
	"SELECT s.shardid, s.shardminvalue::pg_catalog.int4, s.shardmaxvalue::pg_catalog.int4," \
	" p.colocationid, EXISTS (SELECT FROM pg_catalog.pg_dist_placement pl," \
	" pg_catalog.pg_dist_local_group g WHERE pl.shardid OPERATOR(pg_catalog.=) s.shardid" \
	" AND pl.groupid OPERATOR(pg_catalog.=) g.groupid)," \
	" COALESCE(p.partmethod OPERATOR(pg_catalog.=) 'h'::pg_catalog.\"char\"" \
	" AND pg_catalog.column_to_column_name(p.logicalrelid, p.partkey)" \
	" OPERATOR(pg_catalog.=) 'scope', false), p.partkey" \
	" FROM pg_catalog.pg_dist_partition p JOIN pg_catalog.pg_dist_shard s" \
	" ON s.logicalrelid OPERATOR(pg_catalog.=) p.logicalrelid" \
	" WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1" \
	" ORDER BY 2"

/* A shard of idempotency.keys. */
typedef struct KeysShard
{
	int32		min;			/* its range of Citus's hash of the scope */
	int32		max;
	int64		shardid;
	bool		local;			/* this node holds a placement of it */
	bool		described;		/* rel is filled in (local shards, on first use) */
	IdemKeysRel rel;
} KeysShard;

/*
 * The shard map, per backend: loaded from Citus's catalogs, and forgotten
 * with the relcache entry of idempotency.keys, which Citus invalidates
 * whenever shards or placements change.  Sorted by hash range, so that a
 * shard's index is Citus's shard index, part of its lock tag.
 */
static struct
{
	bool		valid;
	Oid			keys_relid;		/* the table it was loaded for */
	bool		distributed;
	bool		floored;		/* the fence floor was set since it was loaded */
	uint32		colocationid;
	Oid			scope_type;		/* the type and collation Citus hashes scopes as */
	Oid			scope_collation;
	int			nshards;
	KeysShard  *shards;
} map;

static MemoryContext map_cxt = NULL;

/* The API functions that take a scope: Citus delegates them by it. */
typedef struct ApiFunction
{
	const char *name;
	int			nargs;
	Oid			argtypes[7];
	int			scope_argno;
} ApiFunction;

/* claim has two forms: the library may be newer than the extension's objects (1.1). */
static const ApiFunction api_functions[] = {
	{"claim", 7, {TEXTOID, BYTEAOID, TEXTOID, INTERVALOID, INTERVALOID, INTERVALOID, UUIDOID}, 2},
	{"claim", 6, {TEXTOID, BYTEAOID, TEXTOID, INTERVALOID, INTERVALOID, INTERVALOID}, 2},
	{"complete", 6, {TEXTOID, INT8OID, INT4OID, BYTEAOID, JSONBOID, TEXTOID}, 5},
	{"release", 3, {TEXTOID, INT8OID, TEXTOID}, 2},
	{"extend", 4, {TEXTOID, INT8OID, INTERVALOID, TEXTOID}, 3},
	{"checkpoint", 5, {TEXTOID, INT8OID, TEXTOID, JSONBOID, TEXTOID}, 4},
	{"lookup", 2, {TEXTOID, TEXTOID}, 1},
};

#define NUM_API_FUNCTIONS ((int) lengthof(api_functions))

/* Their OIDs in this database (InvalidOid without the extension); forgotten when pg_proc changes. */
static Oid	api_oids[NUM_API_FUNCTIONS];
static bool api_oids_valid = false;

static create_upper_paths_hook_type prev_create_upper_paths_hook = NULL;

/*
 * Forgets the shard map when Citus (or DDL) invalidates idempotency.keys,
 * and the description of a local shard when its own relation is
 * invalidated (a DBA's ALTER TABLE on the shard itself).
 */
static void
map_invalidate(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == map.keys_relid)
		map.valid = false;
	else if (map.valid)
		for (int i = 0; i < map.nshards; i++)
			if (map.shards[i].described && map.shards[i].rel.relid == relid)
				map.shards[i].described = false;
}

/*
 * Reads the shards of keys_relid from Citus's catalogs into the map, as they
 * are committed now, whatever the transaction's snapshot: a move that
 * committed since it began must be seen (Citus reads its metadata so too).
 */
static void
map_read_shards(Oid keys_relid)
{
	Oid			argtypes[1] = {OIDOID};
	Datum		args[1] = {ObjectIdGetDatum(keys_relid)};
	SPIPlanPtr	plan;
	MemoryContext old;
	bool		isnull;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	plan = SPI_prepare(SHARDS_SQL, 1, argtypes);
	if (plan == NULL)
		elog(ERROR, "SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
	/* A parallel worker cannot take a snapshot: it has its leader's. */
	if (SPI_execute_snapshot(plan, args, NULL,
							 IsInParallelMode() ? GetActiveSnapshot() : GetLatestSnapshot(),
							 InvalidSnapshot, true, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the shards of idempotency.keys from Citus's catalogs");

	/* Distributed otherwise (a reference table, by another column): refuse to guess. */
	if (SPI_processed > 0 &&
		!DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 6, &isnull)))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.keys is distributed in a way the extension cannot use"),
				 errdetail("The records must be hash-distributed by scope."),
				 errhint("Undistribute the table and call idempotency.citus_distribute().")));

	old = MemoryContextSwitchTo(map_cxt);
	map.nshards = (int) SPI_processed;
	map.shards = palloc0(sizeof(KeysShard) * Max(map.nshards, 1));
	MemoryContextSwitchTo(old);
	for (int i = 0; i < map.nshards; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		KeysShard  *s = &map.shards[i];

		s->shardid = DatumGetInt64(SPI_getbinval(tup, desc, 1, &isnull));
		s->min = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));
		s->max = DatumGetInt32(SPI_getbinval(tup, desc, 3, &isnull));
		map.colocationid = DatumGetUInt32(SPI_getbinval(tup, desc, 4, &isnull));
		if (i == 0)
		{
			Node	   *partkey = stringToNode(TextDatumGetCString(SPI_getbinval(tup, desc, 7,
																					&isnull)));

			if (!IsA(partkey, Var))
				elog(ERROR, "the distribution column of idempotency.keys is not a column");
			map.scope_type = ((Var *) partkey)->vartype;
			map.scope_collation = ((Var *) partkey)->varcollid;
		}
		s->local = DatumGetBool(SPI_getbinval(tup, desc, 5, &isnull));
	}
	SPI_finish();
	map.distributed = map.nshards > 0;
}

/* Loads the shard map of keys_relid: empty when Citus is not installed here. */
static void
map_load(Oid keys_relid)
{
	if (map_cxt == NULL)
	{
		map_cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency Citus shards",
										ALLOCSET_SMALL_SIZES);
		CacheRegisterRelcacheCallback(map_invalidate, (Datum) 0);
	}
	MemoryContextReset(map_cxt);
	map.shards = NULL;
	map.nshards = 0;
	map.distributed = false;
	map.floored = false;
	map.keys_relid = keys_relid;
	/* Valid from here: an invalidation while reading marks it invalid again. */
	map.valid = true;
	PG_TRY();
	{
		if (OidIsValid(get_extension_oid("citus", true)))
			map_read_shards(keys_relid);
	}
	PG_CATCH();
	{
		/* A read that failed (a cancel, a timeout) must not leave an empty map behind. */
		map.valid = false;
		PG_RE_THROW();
	}
	PG_END_TRY();
}

/* Tells whether idempotency.keys (keys_relid) is distributed with Citus; loads the map. */
static bool
keys_distributed(Oid keys_relid)
{
	if (!map.valid || map.keys_relid != keys_relid)
		map_load(keys_relid);
	return map.distributed;
}

/*
 * Returns the shard whose hash range holds value, a value of scope type st:
 * Citus hashes a distribution column's value with the hash function of its
 * type's default hash operator class, in the column's collation.
 */
static KeysShard *
map_find(const IdemScopeType *st, Datum value)
{
	TypeCacheEntry *tc = lookup_type_cache(st->type, TYPECACHE_HASH_PROC_FINFO);
	int32		h;
	int			lo = 0;
	int			hi = map.nshards - 1;

	if (!OidIsValid(tc->hash_proc_finfo.fn_oid))
		elog(ERROR, "type %s has no default hash function", format_type_be(st->type));
	h = DatumGetInt32(FunctionCall1Coll(&tc->hash_proc_finfo, st->collation, value));
	while (lo <= hi)
	{
		int			mid = lo + (hi - lo) / 2;

		if (h < map.shards[mid].min)
			hi = mid - 1;
		else if (h > map.shards[mid].max)
			lo = mid + 1;
		else
			return &map.shards[mid];
	}
	elog(ERROR, "no shard of idempotency.keys covers hash %d", h);
	return NULL;				/* keep compiler quiet */
}

/*
 * Takes Citus's placement lock of shard s in share mode until the end of the
 * transaction; with nowait, only if it is free now.  Returns whether it is
 * held.
 */
static bool
lock_placement(const KeysShard *s, bool nowait)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (s - map.shards), map.colocationid,
						 CITUS_COLOCATED_SHARDS_LOCK_CLASS);
	return LockAcquire(&tag, ShareLock, false, nowait) != LOCKACQUIRE_NOT_AVAIL;
}

/* Returns the OID of the relation of local shard s. */
static Oid
shard_relid(const KeysShard *s)
{
	const IdemKeysCatalog *c = idem_keys_catalog();
	char		name[NAMEDATALEN];
	Oid			relid;

	if (s->described)
		return s->rel.relid;
	snprintf(name, sizeof(name), "keys_" INT64_FORMAT, s->shardid);
	relid = get_relname_relid(name, c->namespace);
	if (!OidIsValid(relid))
		elog(ERROR, "shard idempotency.%s is placed on this node but does not exist", name);
	return relid;
}

/* Returns the description of local shard s's relation. */
static const IdemKeysRel *
shard_rel(KeysShard *s)
{
	if (!s->described)
	{
		Relation	rel = table_open(shard_relid(s), AccessShareLock);

		idem_keys_rel_describe(rel, &s->rel);
		table_close(rel, NoLock);
		s->described = true;
	}
	return &s->rel;
}

/*
 * Raises 55000 unless the scope column of rel, this node's idempotency.keys,
 * has the type and collation Citus distributes the records by (the map's):
 * else Citus and the extension would read the scope as different types.
 */
static void
check_scope_type(const IdemKeysRel *rel)
{
	if (rel->scope.type != map.scope_type || rel->scope.collation != map.scope_collation)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("column \"scope\" of idempotency.keys on this node does not have the type its records are distributed by"),
				 errdetail("It is %s; Citus distributes the records by %s.",
						   format_type_be(rel->scope.type), format_type_be(map.scope_type)),
				 errhint("Run idempotency.citus_distribute() on the coordinator again: it gives every node's table the tenant's type.")));
}

/* Raises 22004 for a call without a scope, which Citus cannot route. */
static void
null_scope_error(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
			 errmsg("argument \"%s\" must not be null", "scope"),
			 errdetail("idempotency.keys is distributed by scope with Citus: the setting idempotency.scope is not used."),
			 errhint("Pass the scope explicitly.")));
}

/*
 * Makes the call work on the relation that holds scope's records on this
 * node: idempotency.keys itself when it is not distributed (the call's
 * relation already), else the scope's local shard, whose placement lock it
 * holds until the end of the transaction; and sets the call's scope value,
 * of that relation's scope type.  Raises IK002 when another node holds that
 * shard, 22004 when the scope argument was omitted (NULL), and 22P02 when
 * the scope is not a value of the tenant's type.
 */
void
idem_citus_locate(IdemCall *call, const char *function, text *scope, bool scope_omitted)
{
	KeysShard  *s;
	Oid			scope_type = call->rel.scope.type;

	for (;;)
	{
		/* 22P02, before anything is read or written, for a scope of another type. */
		if (!keys_distributed(call->rel.relid))
		{
			/* A scope of another type than text is read by its type's input function. */
			if (!call->rel.scope.is_text)
				idem_call_restrict(call);
			call->scope = idem_scope_value(&call->rel, scope);
			return;
		}
		/* Citus's code runs from here on. */
		idem_call_restrict(call);
		if (scope_omitted)
			null_scope_error();
		check_scope_type(&call->rel);
		call->scope = idem_scope_value(&call->rel, scope);
		s = map_find(&call->rel.scope, call->scope);
		lock_placement(s, false);
		/* A move that committed while we waited for the lock has invalidated the map. */
		AcceptInvalidationMessages();
		if (map.valid)
			break;
	}
	if (!s->local)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_NODE),
				 errmsg("%s must run on the node that holds the records of scope \"%s\"",
						function, text_to_cstring(scope)),
				 errdetail("idempotency.keys is distributed with Citus and this node holds no placement of shard %lld.",
						   (long long) s->shardid),
				 errhint("Call it on its own (SELECT * FROM idempotency.claim(...) or SELECT idempotency.complete(...)) with a constant scope, so that Citus delegates it.")));
	call->rel = *shard_rel(s);
	/* A shard made before its table's scope had the tenant's type (not by the extension). */
	if (call->rel.scope.type != scope_type)
		call->scope = idem_scope_value(&call->rel, scope);
}

/*
 * Before a claim draws fences: the first time after shards may have arrived
 * (the map was loaded since), raises the fence sequence to the clock, in
 * microseconds.  Keys whose records left with their shard (released, reaped)
 * had fences from another node's sequence, floored the same way and drawn
 * fewer than one per microsecond: the clock is above them, as long as the
 * nodes' clocks agree within the time a move takes.  Records that came with
 * a shard carry their fence, and a takeover draws above it.
 */
void
idem_citus_floor_fences(void)
{
	if (!map.distributed || map.floored)
		return;
	(void) idem_keys_next_fence((int64) GetCurrentTimestamp());
	map.floored = true;
}

/* Returns a copy of rel in the current memory context. */
static IdemKeysRel *
copy_rel(const IdemKeysRel *rel)
{
	IdemKeysRel *copy = palloc(sizeof(IdemKeysRel));

	*copy = *rel;
	return copy;
}

/*
 * Returns the relations (IdemKeysRel *) whose expired records this node
 * reaps: idempotency.keys when it is not distributed, else each local shard
 * that nothing excludes now (a move holds its placement lock, DDL its
 * relation); their locks are held until the end of the transaction.
 */
List *
idem_citus_local_rels(void)
{
	const IdemKeysCatalog *c = idem_keys_catalog();

	for (;;)
	{
		List	   *rels = NIL;

		if (!keys_distributed(c->keys.relid))
			return list_make1(copy_rel(&c->keys));
		for (int i = 0; i < map.nshards; i++)
		{
			KeysShard  *s = &map.shards[i];

			if (s->local && lock_placement(s, true) &&
				ConditionalLockRelationOid(shard_relid(s), RowExclusiveLock))
				rels = lappend(rels, copy_rel(shard_rel(s)));
		}
		AcceptInvalidationMessages();
		if (map.valid)
			return rels;
	}
}

/* Forgets the OIDs of the API functions when pg_proc changes. */
static void
api_oids_invalidate(Datum arg, int cacheid, uint32 hashvalue)
{
	api_oids_valid = false;
}

/* Looks up the OIDs of the API functions in this database (without permission checks). */
static void
api_oids_load(void)
{
	static bool callback_registered = false;
	Oid			nsp = get_namespace_oid("idempotency", true);

	if (!callback_registered)
	{
		CacheRegisterSyscacheCallback(PROCOID, api_oids_invalidate, (Datum) 0);
		callback_registered = true;
	}
	for (int i = 0; i < NUM_API_FUNCTIONS; i++)
		api_oids[i] = !OidIsValid(nsp) ? InvalidOid :
			GetSysCacheOid3(PROCNAMEARGSNSP, Anum_pg_proc_oid,
							CStringGetDatum(api_functions[i].name),
							PointerGetDatum(buildoidvector(api_functions[i].argtypes,
														   api_functions[i].nargs)),
							ObjectIdGetDatum(nsp));
	api_oids_valid = true;
}

/*
 * Returns the scope constant c (text or varchar) as Citus can route it when
 * the records' scope has a tenant type that text cannot be assigned to
 * (bigint, integer, uuid): an untyped literal, which Citus reads as a value
 * of that type (in a transaction block it routes a call only by a constant,
 * so a cast would not do), and which it sends to the worker unlabelled,
 * where it is text again.  Executed where it is (a call Citus did not
 * delegate), the function receives a C string: idem_arg_scope reads it.
 * Raises 22P02, naming the type, when the scope is not a value of it.
 */
static Node *
untyped_scope(Const *c, const IdemKeysRel *keys)
{
	text	   *scope = DatumGetTextPP(c->constvalue);

	(void) idem_scope_value(keys, scope);
	return (Node *) makeConst(UNKNOWNOID, -1, InvalidOid, -2,
							  CStringGetDatum(text_to_cstring(scope)), false, false);
}

/*
 * For each call of an API function, when keys is distributed: raises 22004
 * when its scope is a NULL constant, and gives a constant scope the tenant's
 * type (untyped_scope) where the scope column has a type other than text.
 */
static bool
scope_walker(Node *node, void *context)
{
	if (node == NULL)
		return false;
	if (IsA(node, FuncExpr))
	{
		FuncExpr   *f = (FuncExpr *) node;

		for (int i = 0; i < NUM_API_FUNCTIONS; i++)
		{
			const IdemKeysRel *keys;
			ListCell   *arg;
			Node	   *scope;

			if (f->funcid != api_oids[i] || list_length(f->args) <= api_functions[i].scope_argno)
				continue;
			arg = list_nth_cell(f->args, api_functions[i].scope_argno);
			scope = strip_implicit_coercions(lfirst(arg));
			if (!IsA(scope, Const))
				continue;
			keys = &idem_keys_catalog()->keys;
			if (!keys_distributed(keys->relid))
				continue;
			if (((Const *) scope)->constisnull)
				null_scope_error();
			check_scope_type(keys);
			if (!keys->scope.is_text &&
				(((Const *) scope)->consttype == TEXTOID ||
				 ((Const *) scope)->consttype == VARCHAROID))
				lfirst(arg) = untyped_scope((Const *) scope, keys);
		}
	}
	return expression_tree_walker(node, scope_walker, context);
}

/*
 * The guard: inside standard_planner, once defaults are inserted, constants
 * folded, custom-plan parameters bound and SQL functions inlined, and before
 * Citus's planner reads the distribution argument of a delegated call,
 * refuses a NULL scope and types a constant one (scope_walker).
 */
static void
null_scope_guard(PlannerInfo *root, UpperRelationKind stage, RelOptInfo *input_rel,
				 RelOptInfo *output_rel, void *extra)
{
	ListCell   *lc;

	if (prev_create_upper_paths_hook)
		prev_create_upper_paths_hook(root, stage, input_rel, output_rel, extra);
	if (stage != UPPERREL_FINAL)
		return;
	if (!api_oids_valid)
		api_oids_load();
	if (!OidIsValid(api_oids[0]) && !OidIsValid(api_oids[1]))
		return;					/* the extension is not installed in this database */
	(void) scope_walker((Node *) root->parse->targetList, NULL);
	foreach(lc, root->parse->rtable)
	{
		RangeTblEntry *rte = lfirst_node(RangeTblEntry, lc);

		if (rte->rtekind == RTE_FUNCTION)
			(void) scope_walker((Node *) rte->functions, NULL);
	}
}

/* Installs the NULL-scope guard when preloading; called from _PG_init. */
void
idem_citus_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_create_upper_paths_hook = create_upper_paths_hook;
	create_upper_paths_hook = null_scope_guard;
}
