/*-------------------------------------------------------------------------
 * keysrel.c
 *	  What a relation that holds records is, for the executor-free reads
 *	  and writes (keysread.c, keyswrite.c): its columns, and its key index,
 *	  through which a claim finds the records of a (scope, key).
 *
 * The extension makes the primary key (key, scope, owner); a DBA may build
 * it again in another column order, or replace it with a unique constraint.
 * Nothing here assumes an order: a key index is any unique, immediate btree
 * index whose columns are exactly key, scope and owner, in any order,
 * without expressions, predicate or included columns, each with its
 * column's collation and an operator class of its type's default btree
 * family (so that its equality is the one the SPI plans' `=` uses: never
 * another record's key or scope taken for the caller's).  A scan of it
 * finds each of key and scope at its own position in the index, compared
 * with the index's own equality for that position, whose input type the
 * column's value has: never a comparator of another type.  (An index that
 * leads with owner is read whole by each scan: slower, still right.)  A
 * table without a key index has no way to decide a race of claims: claim
 * and complete refuse (55000), naming what they need.
 *
 * The facts are decided once per relcache build of the relation, and kept
 * in a short array without pointers: an entry is forgotten in the
 * invalidation callback, and read only once the relation is open, after
 * the invalidations that opening it read.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/nbtree.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/transam.h"
#include "catalog/pg_am.h"
#include "catalog/pg_index.h"
#include "commands/defrem.h"
#include "parser/parse_coerce.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "compat.h"
#include "keysrel.h"

#define MAX_REL_FACTS 64

static IdemRelFacts rel_facts[MAX_REL_FACTS];
static int	rel_facts_count = 0;

/*
 * Forgets the facts of relation relid (all of them for InvalidOid) when its
 * relcache entry goes.  Facts are marked, not moved: a write deciding on an
 * entry may read invalidations meanwhile, and then decides for none.
 */
static void
facts_invalidate(Datum arg, Oid relid)
{
	if (!OidIsValid(relid))
		rel_facts_count = 0;
	for (int i = 0; i < rel_facts_count; i++)
		if (rel_facts[i].relid == relid)
			rel_facts[i].relid = InvalidOid;
}

/* Registers facts_invalidate, once (PostgreSQL has few slots for such callbacks). */
static void
register_invalidation(void)
{
	static bool registered = false;

	if (!registered)
		CacheRegisterRelcacheCallback(facts_invalidate, (Datum) 0);
	registered = true;
}

/*
 * Describes index column i (0-based) of index, on table column attr, into
 * scan when it can serve as a column of a key index: its operator family
 * is the default btree one of the column's type, its collation the
 * column's, the column's type binary-coercible to its input type, and it
 * has an equality for that type.  Notes whether the functions a scan of it
 * calls (its equality and its order function) are built in: else a
 * user's code runs in each scan (owner.c).
 */
static bool
key_column_scan(Relation index, int i, Form_pg_attribute attr, IdemKeyScan *scan)
{
	Oid			opclass = GetDefaultOpClass(attr->atttypid, BTREE_AM_OID);
	Oid			eq_opr;

	if (!OidIsValid(opclass) || get_opclass_family(opclass) != index->rd_opfamily[i] ||
		index->rd_indcollation[i] != attr->attcollation ||
		!IsBinaryCoercible(attr->atttypid, index->rd_opcintype[i]))
		return false;
	eq_opr = get_opfamily_member(index->rd_opfamily[i], index->rd_opcintype[i],
								 index->rd_opcintype[i], BTEqualStrategyNumber);
	if (!OidIsValid(eq_opr))
		return false;
	scan->indexcol = i + 1;
	scan->eq = get_opcode(eq_opr);
	scan->subtype = index->rd_opcintype[i];
	scan->collation = index->rd_indcollation[i];
	scan->builtin = scan->eq < FirstNormalObjectId &&
		index_getprocid(index, i + 1, BTORDER_PROC) < FirstNormalObjectId;
	return true;
}

/*
 * Tells whether index, of rel, whose columns are att, is a key index
 * (see above); fills in key_scan and scope_scan when they are not NULL.
 */
static bool
key_index_scan(Relation rel, Relation index, const AttrNumber *att,
			   IdemKeyScan *key_scan, IdemKeyScan *scope_scan)
{
	Form_pg_index form = index->rd_index;
	TupleDesc	desc = RelationGetDescr(rel);
	int			seen = 0;

	if (index->rd_rel->relam != BTREE_AM_OID || !form->indisunique || !form->indimmediate ||
		form->indnatts != 3 || form->indnkeyatts != 3 ||
		!heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL))
		return false;
	for (int i = 0; i < 3; i++)
	{
		AttrNumber	attnum = form->indkey.values[i];
		Form_pg_attribute attr;
		IdemKeyScan scan;
		int			bit;

		/* 0 is an expression; each of the three columns exactly once. */
		bit = attnum == att[IDEM_COL_KEY] ? 1 : attnum == att[IDEM_COL_SCOPE] ? 2 :
			attnum == att[IDEM_COL_OWNER] ? 4 : 0;
		if (attnum <= 0 || bit == 0 || (seen & bit))
			return false;
		seen |= bit;
		attr = TupleDescAttr(desc, attnum - 1);
		if (!key_column_scan(index, i, attr, &scan))
			return false;
		if (bit == 1 && key_scan)
			*key_scan = scan;
		if (bit == 2 && scope_scan)
			*scope_scan = scan;
	}
	return true;
}

/* Tells whether index, of rel, whose columns are att, is a key index (see above). */
bool
idem_is_key_index(Relation rel, Relation index, const AttrNumber *att)
{
	return key_index_scan(rel, index, att, NULL, NULL);
}

/*
 * Finds the key index that claim's read scans, into f: a valid key index,
 * the primary key when it is one; InvalidOid when rel has none.  Each
 * index is opened to be described (a lock on it kept, as a write keeps).
 */
static void
find_key_index(Relation rel, IdemRelFacts *f)
{
	Oid			pk = RelationGetPrimaryKeyIndex(rel);
	List	   *oids = RelationGetIndexList(rel);
	ListCell   *lc;

	f->key_index = InvalidOid;
	foreach(lc, oids)
	{
		Relation	index = index_open(lfirst_oid(lc), AccessShareLock);
		IdemKeyScan key_scan;
		IdemKeyScan scope_scan;

		if (index->rd_index->indisvalid && index->rd_index->indislive &&
			(!OidIsValid(f->key_index) || RelationGetRelid(index) == pk) &&
			key_index_scan(rel, index, f->att, &key_scan, &scope_scan))
		{
			f->key_index = RelationGetRelid(index);
			f->key_scan = key_scan;
			f->scope_scan = scope_scan;
		}
		index_close(index, NoLock);
	}
	list_free(oids);
}

/*
 * Returns the facts of rel, the call's relation, open; raises 42804 when a
 * column's type changed (catalog.c), and 40001 when its columns moved, or
 * its scope column took another type or collation, since the call
 * described it (within a transaction that had not yet seen the change):
 * the call's scope value is of the type it described.
 */
IdemRelFacts *
idem_rel_facts(const IdemCall *call, Relation rel)
{
	IdemRelFacts *f = NULL;

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
		find_key_index(rel, f);
		f->direct = -1;
		f->direct_own_code = false;
	}
	if (memcmp(f->att, call->rel.att, sizeof(f->att)) != 0 ||
		f->scope_type != call->rel.scope.type || f->scope_collation != call->rel.scope.collation)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("the columns of %s changed during the transaction", call->rel.name),
				 errhint("Retry the transaction.")));
	return f;
}

/*
 * Raises 55000 when the call's relation, of facts f, has no key index (a
 * DBA dropped or changed the primary key): without one, nothing decides a
 * race of claims, and no scan finds complete's record.
 */
void
idem_require_key_index(const IdemCall *call, const IdemRelFacts *f)
{
	if (!OidIsValid(f->key_index))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s has no primary key or unique index on (key, scope, owner)",
						call->rel.name),
				 errdetail("Claims find a record, and decide their races, through a valid unique btree index on exactly those three columns, in any order, without expressions or predicate, with the columns' collations and default operator classes."),
				 errhint("Add one, for example with ALTER TABLE %s ADD UNIQUE (key, scope, owner).",
						 call->rel.name)));
}

/*
 * Opens the key index of rel, the call's relation, into out, with how to
 * scan it; raises 55000 when rel has none.
 */
void
idem_key_index_open(const IdemCall *call, Relation rel, IdemKeyIndex *out)
{
	const IdemRelFacts *f = idem_rel_facts(call, rel);

	idem_require_key_index(call, f);
	out->key = f->key_scan;
	out->scope = f->scope_scan;
	out->builtin = f->key_scan.builtin && f->scope_scan.builtin &&
		rel->rd_rel->relam < FirstNormalObjectId;
	out->index = index_open(f->key_index, RowExclusiveLock);
}

/* Fills in scan key skey of a key index column, scanned for value. */
static void
key_scan_entry(ScanKey skey, const IdemKeyScan *scan, Datum value)
{
	ScanKeyEntryInitialize(skey, 0, scan->indexcol, BTEqualStrategyNumber, scan->subtype,
						   scan->collation, scan->eq, value);
}

/*
 * Starts a scan of ki, the key index of rel, for the records of the call's
 * (scope, key), whatever positions the two columns have in it (the scan
 * keys in the index's column order, as btree wants them).
 */
IndexScanDesc
idem_key_scan_begin(Relation rel, const IdemKeyIndex *ki, Snapshot snapshot,
					const IdemCall *call, text *key)
{
	bool		key_first = ki->key.indexcol < ki->scope.indexcol;
	ScanKeyData skey[2];
	IndexScanDesc scan;

	key_scan_entry(&skey[key_first ? 0 : 1], &ki->key, PointerGetDatum(key));
	key_scan_entry(&skey[key_first ? 1 : 0], &ki->scope, call->scope);
	scan = index_beginscan(rel, ki->index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	return scan;
}
