/*-------------------------------------------------------------------------
 * catalog.c
 *	  What the extension knows of its own objects, looked up in the system
 *	  catalogs once per backend: the columns of idempotency.keys (or of a
 *	  Citus shard of it) and their types, the table's owner, the fence
 *	  sequence, and the values of idempotency.state.
 *
 * A DBA may change the table (ALTER COLUMN ... TYPE among others): the
 * columns are described again whenever its relcache entry is invalidated,
 * and a column whose type changed makes the API refuse, clearly (42804),
 * rather than read or store a value of the wrong type.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_enum.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "parser/parse_relation.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/typcache.h"

#include "catalog.h"
#include "compat.h"

static IdemKeysCatalog catalog;
static bool catalog_valid = false;

/* The columns of idempotency.keys, by IdemKeysColumn. */
static const char *const column_names[IDEM_NUM_COLS] = {
	[IDEM_COL_FENCE] = "fence",
	[IDEM_COL_CREATED_AT] = "created_at",
	[IDEM_COL_EXPIRES_AT] = "expires_at",
	[IDEM_COL_LEASE_EXPIRES_AT] = "lease_expires_at",
	[IDEM_COL_COMPLETED_AT] = "completed_at",
	[IDEM_COL_LEASE] = "lease",
	[IDEM_COL_ATTEMPT] = "attempt",
	[IDEM_COL_STATUS_CODE] = "status_code",
	[IDEM_COL_STATE] = "state",
	[IDEM_COL_OWNER] = "owner",
	[IDEM_COL_SCOPE] = "scope",
	[IDEM_COL_KEY] = "key",
	[IDEM_COL_FINGERPRINT] = "fingerprint",
	[IDEM_COL_RECOVERY_POINT] = "recovery_point",
	[IDEM_COL_RECOVERY_STATE] = "recovery_state",
	[IDEM_COL_HEADERS] = "headers",
	[IDEM_COL_BODY] = "body",
	[IDEM_COL_TOKEN] = "token",
};

/*
 * The types of the columns, as the extension made them (without a type
 * modifier); InvalidOid for state, whose type is idempotency.state.  The
 * direct reads and writes take and store values of exactly these types.
 */
static const Oid column_types[IDEM_NUM_COLS] = {
	[IDEM_COL_FENCE] = INT8OID,
	[IDEM_COL_CREATED_AT] = TIMESTAMPTZOID,
	[IDEM_COL_EXPIRES_AT] = TIMESTAMPTZOID,
	[IDEM_COL_LEASE_EXPIRES_AT] = TIMESTAMPTZOID,
	[IDEM_COL_COMPLETED_AT] = TIMESTAMPTZOID,
	[IDEM_COL_LEASE] = INTERVALOID,
	[IDEM_COL_ATTEMPT] = INT4OID,
	[IDEM_COL_STATUS_CODE] = INT4OID,
	[IDEM_COL_STATE] = InvalidOid,
	[IDEM_COL_OWNER] = REGROLEOID,
	[IDEM_COL_SCOPE] = TEXTOID,
	[IDEM_COL_KEY] = TEXTOID,
	[IDEM_COL_FINGERPRINT] = BYTEAOID,
	[IDEM_COL_RECOVERY_POINT] = TEXTOID,
	[IDEM_COL_RECOVERY_STATE] = JSONBOID,
	[IDEM_COL_HEADERS] = JSONBOID,
	[IDEM_COL_BODY] = BYTEAOID,
	[IDEM_COL_TOKEN] = UUIDOID,
};

/* Forgets the cached catalog facts when the table's relcache entry goes. */
static void
catalog_invalidate(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == catalog.keys.relid ||
		relid == catalog.fence_seq_relid)
		catalog_valid = false;
}

/*
 * Raises 42804 unless column col of rel (named name), number attnum, has
 * the type, and for the key's columns the collation, the extension gave it:
 * a DBA's ALTER COLUMN ... TYPE makes the API refuse, clearly, rather than
 * read or store a value of the wrong type.
 */
static void
check_column_type(Relation rel, const char *name, IdemKeysColumn col, AttrNumber attnum)
{
	Form_pg_attribute attr = TupleDescAttr(RelationGetDescr(rel), attnum - 1);
	Oid			type = column_types[col];
	bool		c_collated = (col == IDEM_COL_SCOPE || col == IDEM_COL_KEY);
	bool		collation_differs;

	if (!OidIsValid(type))
		type = GetSysCacheOid2(TYPENAMENSP, Anum_pg_type_oid, CStringGetDatum("state"),
							   ObjectIdGetDatum(RelationGetNamespace(rel)));
	collation_differs = c_collated && attr->atttypid == type &&
		attr->attcollation != C_COLLATION_OID;
	if (attr->atttypid != type || attr->atttypmod != -1 || collation_differs)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("column \"%s\" of %s has type %s%s, not %s%s",
						column_names[col], name,
						format_type_with_typemod(attr->atttypid, attr->atttypmod),
						collation_differs ? " in another collation" : "",
						format_type_be(type), c_collated ? " COLLATE \"C\"" : ""),
				 errdetail("The extension reads and writes the columns of its table with the types it made them with."),
				 errhint("Change the column back with ALTER TABLE %s ALTER COLUMN %s TYPE %s%s.",
						 name, quote_identifier(column_names[col]), format_type_be(type),
						 c_collated ? " COLLATE \"C\"" : "")));
}

/* True when type (without a typmod) is one citus_distribute may give the scope column. */
static bool
tenant_type(Oid type, int32 typmod)
{
	switch (type)
	{
		case TEXTOID:
		case VARCHAROID:
		case INT8OID:
		case INT4OID:
		case UUIDOID:
			return typmod == -1;
		default:
			return false;
	}
}

/*
 * Describes the scope column of rel (named name), number attnum, into out.
 * Besides the extension's text COLLATE "C", it may have the type of a Citus
 * tenant column, which citus_distribute gives it (text or varchar of any
 * collation, bigint, integer, uuid), where Citus is installed; anything
 * else (a DBA's ALTER COLUMN without Citus) is 42804.
 */
static void
describe_scope(Relation rel, const char *name, AttrNumber attnum, IdemScopeType *out)
{
	Form_pg_attribute attr = TupleDescAttr(RelationGetDescr(rel), attnum - 1);
	TypeCacheEntry *tc;
	bool		own_type = attr->atttypid == TEXTOID && attr->atttypmod == -1 &&
		attr->attcollation == C_COLLATION_OID;

	/* The message names text COLLATE "C", the type the extension gives it. */
	if (!own_type && !(tenant_type(attr->atttypid, attr->atttypmod) &&
					   OidIsValid(get_extension_oid("citus", true))))
		check_column_type(rel, name, IDEM_COL_SCOPE, attnum);
	out->type = attr->atttypid;
	out->collation = attr->attcollation;
	out->is_text = (out->type == TEXTOID || out->type == VARCHAROID);
	tc = lookup_type_cache(out->type, TYPECACHE_EQ_OPR);
	if (!OidIsValid(tc->eq_opr))
		elog(ERROR, "type %s has no default equality operator", format_type_be(out->type));
	out->eq = get_opcode(tc->eq_opr);
	getTypeInputInfo(out->type, &out->input, &out->ioparam);
}

/*
 * Describes a relation that holds records (idempotency.keys or a shard of
 * it): its OID, its name for SQL, and the numbers of its columns (token's
 * InvalidAttrNumber on a table of version 1.1).
 */
void
idem_keys_rel_describe(Relation rel, IdemKeysRel *out)
{
	const char *name = quote_qualified_identifier(get_namespace_name(RelationGetNamespace(rel)),
												  RelationGetRelationName(rel));

	out->relid = RelationGetRelid(rel);
	if (strlcpy(out->name, name, sizeof(out->name)) >= sizeof(out->name))
		elog(ERROR, "relation name %s is too long", name);
	for (int i = 0; i < IDEM_NUM_COLS; i++)
	{
		out->att[i] = attnameAttNum(rel, column_names[i], false);
		if (out->att[i] == InvalidAttrNumber && i != IDEM_COL_TOKEN)
			elog(ERROR, "column \"%s\" of %s does not exist", column_names[i], name);
		if (i == IDEM_COL_SCOPE)
			describe_scope(rel, name, out->att[i], &out->scope);
		else if (out->att[i] != InvalidAttrNumber)
			check_column_type(rel, name, (IdemKeysColumn) i, out->att[i]);
	}
}

/*
 * Returns scope as a value of rel's scope column: the text itself for text
 * and varchar, else the value the type's input function reads from it.
 * When it is not one, the input function's error is raised as 22P02 (the
 * design's code for a scope that is not a tenant id), also where the input
 * function says 22003 (a number out of range); an error of another class
 * (out of memory, a cancel) is raised as it is.
 */
Datum
idem_scope_value(const IdemKeysRel *rel, text *scope)
{
	MemoryContext caller = CurrentMemoryContext;
	char	   *value;
	Datum		result = (Datum) 0;

	if (rel->scope.is_text)
		return PointerGetDatum(scope);
	value = text_to_cstring(scope);
	PG_TRY();
	{
		result = OidInputFunctionCall(rel->scope.input, value, rel->scope.ioparam, -1);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		/* Raised again at once: nothing to clean up, no subtransaction needed. */
		MemoryContextSwitchTo(caller);
		edata = CopyErrorData();
		FlushErrorState();
		if (ERRCODE_TO_CATEGORY(edata->sqlerrcode) == ERRCODE_DATA_EXCEPTION)
			edata->sqlerrcode = ERRCODE_INVALID_TEXT_REPRESENTATION;
		ReThrowError(edata);
	}
	PG_END_TRY();
	return result;
}

/* Returns the enum value of label in type enumtype; raises when it is missing. */
static Oid
enum_label(Oid enumtype, const char *label)
{
	Oid			oid = GetSysCacheOid2(ENUMTYPOIDNAME, Anum_pg_enum_oid,
									  ObjectIdGetDatum(enumtype), CStringGetDatum(label));

	if (!OidIsValid(oid))
		elog(ERROR, "enum label \"%s\" of idempotency.state does not exist", label);
	return oid;
}

/* Returns the catalog facts about the extension's objects, cached per backend. */
const IdemKeysCatalog *
idem_keys_catalog(void)
{
	static bool callbacks_registered = false;
	IdemKeysCatalog *c = &catalog;
	Relation	rel;
	Oid			keys_relid;
	Oid			state_type;

	if (catalog_valid)
		return c;

	c->namespace = get_namespace_oid("idempotency", false);
	keys_relid = get_relname_relid("keys", c->namespace);
	c->fence_seq_relid = get_relname_relid("fence_seq", c->namespace);
	if (!OidIsValid(keys_relid) || !OidIsValid(c->fence_seq_relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"idempotency.keys\" does not exist"),
				 errhint("Run CREATE EXTENSION idempotency.")));

	rel = table_open(keys_relid, AccessShareLock);
	c->table_owner = rel->rd_rel->relowner;
	idem_keys_rel_describe(rel, &c->keys);
	state_type = TupleDescAttr(RelationGetDescr(rel), c->keys.att[IDEM_COL_STATE] - 1)->atttypid;
	table_close(rel, AccessShareLock);
	c->in_progress_label = enum_label(state_type, "in_progress");
	c->completed_label = enum_label(state_type, "completed");

	if (!callbacks_registered)
	{
		CacheRegisterRelcacheCallback(catalog_invalidate, (Datum) 0);
		callbacks_registered = true;
	}
	catalog_valid = true;
	return c;
}
