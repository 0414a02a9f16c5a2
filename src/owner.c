/*-------------------------------------------------------------------------
 * owner.c
 *	  The security boundary of the API: the right to call it, and how a
 *	  call acts as the owner of idempotency.keys.
 *
 * Application roles have no privilege on the table; each call checks that
 * its caller has USAGE on schema idempotency (not through pg_monitor's
 * grant), then, for the rest of the call, becomes the table's owner as
 * PostgreSQL's maintenance commands do when they run a table owner's code
 * (VACUUM, ANALYZE, REINDEX, CLUSTER, REFRESH MATERIALIZED VIEW):
 *
 * - SetUserIdAndSecContext to the owner, with SECURITY_RESTRICTED_OPERATION:
 *   code that runs meanwhile (a DBA's index expressions, constraints,
 *   triggers, the functions they call) cannot change the session for the
 *   caller (SET ROLE, temporary objects, cursors left open are refused);
 * - a new GUC nest level with search_path = pg_catalog, pg_temp: names in
 *   that code are never looked up in the caller's search_path, where an
 *   application role could plant its own function to run as the owner.
 *
 * idem_owner_leave undoes both.  An error in between needs nothing of it:
 * (sub)transaction abort restores the user and pops the GUC nest level.
 *
 * The search_path may come later than the user switch (idem_owner_become,
 * then idem_owner_restrict_path), but always before anything runs that is
 * not PostgreSQL's own built-in code: claim's read of the key index, when
 * the index compares with built-in functions only (keysrel.c), runs none
 * and looks up no name, so a replay, a mismatch or an in_progress answer
 * needs no GUC nest level, whose save and restore (AtEOXact_GUC walks every
 * setting on PostgreSQL 15) cost a replay more than a tenth of its
 * instructions.  Nor do a fresh claim's insert and its complete's update
 * on a table whose every index runs built-in code only (and the
 * extension's own C function): keysindex.c decides it, once per relcache
 * build.  Everything else restricts the path first: every SPI plan, the
 * building of an index's expressions, a scope of another type than text,
 * Citus.
 * Nothing else in the extension switches users but fence.c, to raise the
 * fence sequence as its owner.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_namespace.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/inval.h"
#include "utils/syscache.h"

#include "compat.h"
#include "owner.h"

/* The last role found allowed to use the API; forgotten when privileges change. */
static Oid	api_user_checked = InvalidOid;

/* Forgets which role may use the API, when a schema or a role membership changes. */
static void
api_user_invalidate(Datum arg, int cacheid, uint32 hashvalue)
{
	api_user_checked = InvalidOid;
}

/*
 * Tells whether role has USAGE on schema nsp through a grant other than
 * pg_monitor's: the extension grants pg_monitor USAGE so that its members
 * can read idempotency.stats, and that must not hand them the API.
 */
static bool
has_api_usage(Oid nsp, Oid role)
{
	HeapTuple	tup = SearchSysCache1(NAMESPACEOID, ObjectIdGetDatum(nsp));
	Oid			nsp_owner;
	Datum		acl_datum;
	bool		isnull;
	Acl		   *acl;
	AclItem    *items;
	int			kept = 0;
	bool		allowed;

	if (!HeapTupleIsValid(tup))
		elog(ERROR, "cache lookup failed for schema %u", nsp);
	nsp_owner = ((Form_pg_namespace) GETSTRUCT(tup))->nspowner;
	acl_datum = SysCacheGetAttr(NAMESPACEOID, tup, Anum_pg_namespace_nspacl, &isnull);
	acl = isnull ? acldefault(OBJECT_SCHEMA, nsp_owner) : DatumGetAclPCopy(acl_datum);
	ReleaseSysCache(tup);

	/* ACL_DAT, without its signedness warning: an ACL never has NULLs. */
	if (ARR_HASNULL(acl))
		elog(ERROR, "ACL of schema %u contains nulls", nsp);
	items = (AclItem *) ((char *) acl + ARR_OVERHEAD_NONULLS(ARR_NDIM(acl)));
	for (int i = 0; i < ACL_NUM(acl); i++)
		if (items[i].ai_grantee != ROLE_PG_MONITOR)
			items[kept++] = items[i];
	ARR_DIMS(acl)[0] = kept;
	SET_VARSIZE(acl, ACL_N_SIZE(kept));

	allowed = aclmask(acl, role, nsp_owner, ACL_USAGE, ACLMASK_ANY) != 0;
	pfree(acl);
	return allowed;
}

/* Raises 42501 unless role caller may use the API, whose schema is nsp. */
void
idem_owner_check_caller(Oid nsp, Oid caller)
{
	static bool callbacks_registered = false;

	if (!callbacks_registered)
	{
		CacheRegisterSyscacheCallback(NAMESPACEOID, api_user_invalidate, (Datum) 0);
		CacheRegisterSyscacheCallback(AUTHMEMROLEMEM, api_user_invalidate, (Datum) 0);
		CacheRegisterSyscacheCallback(AUTHOID, api_user_invalidate, (Datum) 0);
		callbacks_registered = true;
	}
	if (caller == api_user_checked)
		return;
	if (!has_api_usage(nsp, caller))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for schema %s", "idempotency"),
				 errdetail("Membership in pg_monitor gives access to idempotency.stats only."),
				 errhint("Grant USAGE on schema idempotency to the roles that use the API.")));
	api_user_checked = caller;
}

/*
 * Becomes table_owner in a restricted security context; the search_path is
 * restricted later, by idem_owner_restrict_path.  save says what to restore.
 */
void
idem_owner_become(Oid table_owner, IdemOwnerSave *save)
{
	GetUserIdAndSecContext(&save->userid, &save->sec_context);
	SetUserIdAndSecContext(table_owner, save->sec_context |
						   SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	save->guc_nestlevel = 0;
}

/* Sets search_path pg_catalog, pg_temp in a GUC nest level of its own, once per call. */
void
idem_owner_restrict_path(IdemOwnerSave *save)
{
	if (save->guc_nestlevel > 0)
		return;
	save->guc_nestlevel = NewGUCNestLevel();
	RestrictSearchPath();
}

/*
 * Becomes table_owner in a restricted security context, with search_path
 * pg_catalog, pg_temp in a GUC nest level of its own; save says what to
 * restore.
 */
void
idem_owner_enter(Oid table_owner, IdemOwnerSave *save)
{
	idem_owner_become(table_owner, save);
	idem_owner_restrict_path(save);
}

/* Returns to the caller's search_path (and any setting changed since enter), user and context. */
void
idem_owner_leave(const IdemOwnerSave *save)
{
	if (save->guc_nestlevel > 0)
		AtEOXact_GUC(false, save->guc_nestlevel);
	SetUserIdAndSecContext(save->userid, save->sec_context);
}
