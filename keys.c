/*-------------------------------------------------------------------------
 * keys.c
 *	  Access to idempotency.keys: the catalog facts, the right to use the
 *	  API, the key locks, claim's direct read and every write.
 *
 * Application roles get no privilege on the table: each call switches to
 * the table's owner, as SECURITY DEFINER would but cheaper, and runs SPI
 * plans prepared once per backend.  Every name in the plans is schema-
 * qualified, operators included, so that the caller's search_path cannot
 * change their meaning.  The one read on the hot path, claim's, is a direct
 * primary-key lookup instead, without an executor: it took replays from
 * 0.68x to 0.95x a bare primary-key SELECT (bench/run).
 *
 * A record belongs to the role that claimed it, and is seen only by roles
 * that have the privileges of that owner: for any other role it is as if
 * it were in another scope.  The primary key is (scope, key, owner).
 *
 * Every write of a record first takes its key lock, a transaction-level
 * lock on a hash of (scope, key): a claim that meets another transaction's
 * uncommitted write of its key waits on that lock, as it would on a unique
 * index, but in one place where it can bound the wait and read the clock
 * after it.  The unique index still decides every race: INSERT ... ON
 * CONFLICT, and UPDATEs whose WHERE clause repeats their condition.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/genam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_enum.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "parser/parse_relation.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/resowner.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "keys.h"

/* The fourth field of the advisory lock tags of key locks, as pg_locks shows it (objsubid). */
#define KEY_LOCK_TAG 0x1de

/*
 * The plans.  Operators are written OPERATOR(pg_catalog.x): the plans run as
 * the table's owner, and an operator found through the caller's search_path
 * would run with the owner's rights.
 */
#define EQ " OPERATOR(pg_catalog.=) "
#define NE " OPERATOR(pg_catalog.<>) "
#define LE " OPERATOR(pg_catalog.<=) "
#define PLUS " OPERATOR(pg_catalog.+) "
#define KEY_IS "scope" EQ "$1 AND key" EQ "$2"
#define IN_PROGRESS "'in_progress'::idempotency.state"
#define COMPLETED "'completed'::idempotency.state"
#define NEXT_FENCE "pg_catalog.nextval('idempotency.fence_seq'::pg_catalog.regclass)"
/* The record is seen by the caller, role $n: its own, or one whose privileges it has. */
#define SEEN_BY(n) "(owner" EQ n " OR pg_catalog.pg_has_role(" n ", owner, 'USAGE'))"
/* The caller ($4) sees the record and this fence ($3) owns it. */
#define OWNED_BY_FENCE KEY_IS " AND fence" EQ "$3 AND state" EQ IN_PROGRESS " AND " SEEN_BY("$4")
/* The records that claim treats as absent and reap may delete, at time $n. */
#define EXPIRED_AT(n) "expires_at" LE n " AND (state" EQ COMPLETED " OR lease_expires_at" LE n ")"

typedef enum PlanId
{
	PLAN_INSERT,
	PLAN_RESET,
	PLAN_TAKEOVER,
	PLAN_COMPLETE,
	PLAN_RELEASE,
	PLAN_EXTEND,
	PLAN_CHECKPOINT,
	PLAN_LOOKUP,
	PLAN_REAP,
	NUM_PLANS
} PlanId;

typedef struct PlanDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[8];
} PlanDef;

static const PlanDef plan_defs[NUM_PLANS] = {
	[PLAN_INSERT] = {
		"INSERT INTO idempotency.keys (scope, key, owner, fingerprint, state, fence,"
		" attempt, lease, lease_expires_at, created_at, expires_at)"
		" VALUES ($1, $2, $3, $4, " IN_PROGRESS ", " NEXT_FENCE ", 1, $5, $7" PLUS "$5,"
		" $7, $7" PLUS "$6)"
		" ON CONFLICT (scope, key, owner) DO NOTHING RETURNING fence",
		7, {TEXTOID, TEXTOID, REGROLEOID, BYTEAOID, INTERVALOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_RESET] = {
		"UPDATE idempotency.keys SET fingerprint = $4, state = " IN_PROGRESS ","
		" fence = " NEXT_FENCE ", attempt = 1, lease = $5, lease_expires_at = $7" PLUS "$5,"
		" recovery_point = NULL, recovery_state = NULL, status_code = NULL,"
		" headers = NULL, body = NULL, created_at = $7, completed_at = NULL,"
		" expires_at = $7" PLUS "$6"
		" WHERE " KEY_IS " AND owner" EQ "$3 AND " EXPIRED_AT("$7") " RETURNING fence",
		7, {TEXTOID, TEXTOID, REGROLEOID, BYTEAOID, INTERVALOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_TAKEOVER] = {
		"UPDATE idempotency.keys SET fence = " NEXT_FENCE ", attempt = attempt" PLUS "1,"
		" lease = $5, lease_expires_at = $6" PLUS "$5"
		" WHERE " KEY_IS " AND owner" EQ "$3 AND fence" EQ "$4 AND state" EQ IN_PROGRESS
		" AND lease_expires_at" LE "$6 AND NOT (" EXPIRED_AT("$6") ")"
		" RETURNING fence, attempt, recovery_point, recovery_state, created_at",
		6, {TEXTOID, TEXTOID, REGROLEOID, INT8OID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_COMPLETE] = {
		"UPDATE idempotency.keys SET state = " COMPLETED ", status_code = $5,"
		" headers = $6, body = $7, completed_at = $8, lease_expires_at = NULL"
		" WHERE " OWNED_BY_FENCE,
		8, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, INT4OID, JSONBOID, BYTEAOID, TIMESTAMPTZOID}
	},
	[PLAN_RELEASE] = {
		"DELETE FROM idempotency.keys WHERE " OWNED_BY_FENCE,
		4, {TEXTOID, TEXTOID, INT8OID, REGROLEOID}
	},
	[PLAN_EXTEND] = {
		"UPDATE idempotency.keys SET lease_expires_at ="
		" GREATEST(lease_expires_at, $6" PLUS "COALESCE($5, lease))"
		" WHERE " OWNED_BY_FENCE " RETURNING lease_expires_at",
		6, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_CHECKPOINT] = {
		"UPDATE idempotency.keys SET recovery_point = $5, recovery_state = $6,"
		" lease_expires_at = GREATEST(lease_expires_at, $7" PLUS "lease)"
		" WHERE " OWNED_BY_FENCE,
		7, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, TEXTOID, JSONBOID, TIMESTAMPTZOID}
	},
	[PLAN_LOOKUP] = {
		"SELECT scope, key, fingerprint, state::pg_catalog.text, attempt, lease,"
		" lease_expires_at, recovery_point, recovery_state, status_code, headers,"
		" body, created_at, completed_at, expires_at FROM idempotency.keys"
		" WHERE " KEY_IS " AND " SEEN_BY("$3") " AND NOT (" EXPIRED_AT("$4") ")"
		" ORDER BY owner" NE "$3, owner::pg_catalog.oid LIMIT 1",
		4, {TEXTOID, TEXTOID, REGROLEOID, TIMESTAMPTZOID}
	},
	[PLAN_REAP] = {
		"DELETE FROM idempotency.keys WHERE ctid" EQ "ANY (ARRAY("
		"SELECT ctid FROM idempotency.keys WHERE " EXPIRED_AT("$1")
		" ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED))",
		2, {TIMESTAMPTZOID, INT4OID}
	},
};

static SPIPlanPtr plans[NUM_PLANS];

/*
 * What the calls need to know of the extension's objects, looked up once per
 * backend and forgotten when the table's relcache entry is invalidated (DROP
 * and CREATE EXTENSION): the table's owner, as whom every plan runs, and the
 * table's columns that claim reads directly.
 */
typedef struct KeysCatalog
{
	Oid			namespace;
	Oid			keys_relid;
	Oid			fence_seq_relid;
	Oid			table_owner;
	Oid			completed_label;	/* the enum value 'completed' */
	AttrNumber	owner;
	AttrNumber	fence;
	AttrNumber	state;
	AttrNumber	fingerprint;
	AttrNumber	lease_expires_at;
	AttrNumber	expires_at;
	AttrNumber	created_at;
	AttrNumber	status_code;
	AttrNumber	headers;
	AttrNumber	body;
} KeysCatalog;

static KeysCatalog catalog;
static bool catalog_valid = false;

/* The last role found allowed to use the API; forgotten when privileges change. */
static Oid	api_user_checked = InvalidOid;

/* Forgets the cached catalog facts when the table's relcache entry goes. */
static void
catalog_invalidate(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == catalog.keys_relid ||
		relid == catalog.fence_seq_relid)
		catalog_valid = false;
}

/* Forgets which role may use the API, when a schema or a role membership changes. */
static void
api_user_invalidate(Datum arg, int cacheid, uint32 hashvalue)
{
	api_user_checked = InvalidOid;
}

/* Returns the number of a column of idempotency.keys. */
static AttrNumber
keys_column(Relation rel, const char *name)
{
	AttrNumber	attnum = attnameAttNum(rel, name, false);

	if (attnum == InvalidAttrNumber)
		elog(ERROR, "column \"%s\" of idempotency.keys does not exist", name);
	return attnum;
}

/* Returns the catalog facts about the extension's objects, cached per backend. */
static const KeysCatalog *
get_catalog(void)
{
	static bool callbacks_registered = false;
	KeysCatalog *c = &catalog;
	Relation	rel;

	if (catalog_valid)
		return c;

	c->namespace = get_namespace_oid("idempotency", false);
	c->keys_relid = get_relname_relid("keys", c->namespace);
	c->fence_seq_relid = get_relname_relid("fence_seq", c->namespace);
	if (!OidIsValid(c->keys_relid) || !OidIsValid(c->fence_seq_relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"idempotency.keys\" does not exist"),
				 errhint("Run CREATE EXTENSION idempotency.")));

	rel = table_open(c->keys_relid, AccessShareLock);
	c->table_owner = rel->rd_rel->relowner;
	c->owner = keys_column(rel, "owner");
	c->fence = keys_column(rel, "fence");
	c->state = keys_column(rel, "state");
	c->fingerprint = keys_column(rel, "fingerprint");
	c->lease_expires_at = keys_column(rel, "lease_expires_at");
	c->expires_at = keys_column(rel, "expires_at");
	c->created_at = keys_column(rel, "created_at");
	c->status_code = keys_column(rel, "status_code");
	c->headers = keys_column(rel, "headers");
	c->body = keys_column(rel, "body");
	c->completed_label = GetSysCacheOid2(ENUMTYPOIDNAME, Anum_pg_enum_oid,
										 ObjectIdGetDatum(TupleDescAttr(RelationGetDescr(rel), c->state - 1)->atttypid),
										 CStringGetDatum("completed"));
	table_close(rel, AccessShareLock);
	if (!OidIsValid(c->completed_label))
		elog(ERROR, "enum label \"completed\" of idempotency.state does not exist");

	if (!callbacks_registered)
	{
		CacheRegisterRelcacheCallback(catalog_invalidate, (Datum) 0);
		CacheRegisterSyscacheCallback(NAMESPACEOID, api_user_invalidate, (Datum) 0);
		CacheRegisterSyscacheCallback(AUTHMEMROLEMEM, api_user_invalidate, (Datum) 0);
		CacheRegisterSyscacheCallback(AUTHOID, api_user_invalidate, (Datum) 0);
		callbacks_registered = true;
	}
	catalog_valid = true;
	return c;
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

/* Raises 42501 unless the caller may use the API. */
static void
check_api_privilege(const KeysCatalog *c, Oid role)
{
	if (role == api_user_checked)
		return;
	if (!has_api_usage(c->namespace, role))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for schema %s", "idempotency"),
				 errdetail("Membership in pg_monitor gives access to idempotency.stats only."),
				 errhint("Grant USAGE on schema idempotency to the roles that use the API.")));
	api_user_checked = role;
}

/*
 * Checks that the caller may use the API and connects to SPI as the table's
 * owner.  An error before idem_call_end needs no cleanup: (sub)transaction
 * abort restores the user and closes SPI.
 */
void
idem_call_begin(IdemCall *call)
{
	const KeysCatalog *c = get_catalog();

	call->caller = GetUserId();
	check_api_privilege(c, call->caller);
	call->caller_cxt = CurrentMemoryContext;
	GetUserIdAndSecContext(&call->save_userid, &call->save_sec_context);
	SetUserIdAndSecContext(c->table_owner, call->save_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
}

/* Leaves SPI and returns to the caller's user. */
void
idem_call_end(IdemCall *call)
{
	SPI_finish();
	SetUserIdAndSecContext(call->save_userid, call->save_sec_context);
}

/* Hashes (scope, key): the key lock's tag and the waiters' slot. */
uint64
idem_key_hash(text *scope, text *key)
{
	uint64		h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
										VARSIZE_ANY_EXHDR(key), 0);

	return hash_combine64(h, hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
												 VARSIZE_ANY_EXHDR(scope), 0));
}

/* Fills in the tag of the key lock of keyhash. */
static void
key_lock_tag(LOCKTAG *tag, uint64 keyhash)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (keyhash >> 32), (uint32) keyhash,
						 KEY_LOCK_TAG);
}

/*
 * Waits up to timeout_ms for a lock that is taken, in a subtransaction in
 * which lock_timeout is at most timeout_ms, so that the timeout can be
 * caught.  Returns whether it got the lock; keep: whether it holds it now
 * (for the rest of the transaction), else it released it at once.  An error
 * other than our own timeout (a cancel, a deadlock, the caller's shorter
 * lock_timeout) is raised again.
 */
static bool
acquire_within(const LOCKTAG *tag, long timeout_ms, bool keep)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	int			saved_lock_timeout = LockTimeout;
	bool		ours = (LockTimeout <= 0 || LockTimeout > timeout_ms);
	volatile bool held = false;

	if (timeout_ms <= 0)
		return false;
	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		if (ours)
			LockTimeout = (int) Min(timeout_ms, INT_MAX);
		(void) LockAcquire(tag, ExclusiveLock, false, false);
		LockTimeout = saved_lock_timeout;
		/* Released here, by its owner; or kept, passing to the parent transaction. */
		if (!keep)
			LockRelease(tag, ExclusiveLock, false);
		ReleaseCurrentSubTransaction();
		held = true;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		LockTimeout = saved_lock_timeout;
		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
		if (!ours || edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			ReThrowError(edata);
		FreeErrorData(edata);
	}
	PG_END_TRY();
	MemoryContextSwitchTo(cxt);
	CurrentResourceOwner = owner;
	return held;
}

/*
 * Takes the key lock of keyhash for the rest of the transaction.  When
 * another transaction holds it, waits: without bound but lock_timeout when
 * timeout_ms < 0, else up to timeout_ms.
 */
IdemLockResult
idem_keys_lock(uint64 keyhash, long timeout_ms)
{
	LOCKTAG		tag;

	key_lock_tag(&tag, keyhash);
	if (LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL)
		return IDEM_LOCK_AT_ONCE;
	if (timeout_ms < 0)
	{
		(void) LockAcquire(&tag, ExclusiveLock, false, false);
		return IDEM_LOCK_AFTER_WAIT;
	}
	if (acquire_within(&tag, timeout_ms, true))
		return IDEM_LOCK_AFTER_WAIT;
	return IDEM_LOCK_TIMED_OUT;
}

/*
 * Waits, up to timeout_ms, for a transaction that holds the key lock of
 * keyhash (one writing the record, or one prepared and not yet committed)
 * to end, without keeping the lock: a waiting claim must not block the
 * owner's complete.  Returns how it went.
 */
IdemWriterWait
idem_keys_wait_for_writer(uint64 keyhash, long timeout_ms)
{
	LOCKTAG		tag;

	key_lock_tag(&tag, keyhash);
	switch (LockAcquire(&tag, ExclusiveLock, false, true))
	{
		case LOCKACQUIRE_OK:
			LockRelease(&tag, ExclusiveLock, false);
			return IDEM_NO_WRITER;
		case LOCKACQUIRE_ALREADY_HELD:
			return IDEM_NO_WRITER;	/* this transaction is the writer */
		default:
			break;
	}
	return acquire_within(&tag, timeout_ms, false) ? IDEM_WRITER_ENDED : IDEM_WRITER_STILL_THERE;
}

/* Takes the key lock of (scope, key), waiting as long as lock_timeout allows. */
static void
lock_key(text *scope, text *key)
{
	(void) idem_keys_lock(idem_key_hash(scope, key), -1);
}

/* Runs a plan, preparing and saving it on first use; returns rows processed. */
static uint64
run_plan(PlanId id, Datum *values, const char *nulls, bool read_only)
{
	int			rc;

	if (plans[id] == NULL)
	{
		const PlanDef *def = &plan_defs[id];
		SPIPlanPtr	plan = SPI_prepare(def->sql, def->nargs, (Oid *) def->argtypes);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed for \"%s\": %s",
				 def->sql, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "SPI_keepplan failed");
		plans[id] = plan;
	}
	rc = SPI_execute_plan(plans[id], values, nulls, read_only, 0);
	if (rc < 0)
		elog(ERROR, "SPI_execute_plan failed: %s", SPI_result_code_string(rc));
	return SPI_processed;
}

/* Returns column n of the first result row. */
static Datum
result_col(int n, bool *isnull)
{
	return SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, n, isnull);
}

/* Returns a varlena column of the first result row, detoasted into cxt; NULL when NULL. */
static struct varlena *
result_varlena(int n, MemoryContext cxt)
{
	bool		isnull;
	Datum		value = result_col(n, &isnull);
	MemoryContext old;
	struct varlena *copy;

	if (isnull)
		return NULL;
	old = MemoryContextSwitchTo(cxt);
	copy = PG_DETOAST_DATUM_COPY(value);
	MemoryContextSwitchTo(old);
	return copy;
}

/* Returns a column of the slot's tuple that may not be NULL. */
static Datum
slot_col(TupleTableSlot *slot, AttrNumber attnum)
{
	bool		isnull;
	Datum		value = slot_getattr(slot, attnum, &isnull);

	if (isnull)
		elog(ERROR, "unexpected null in column %d of idempotency.keys", attnum);
	return value;
}

/* Copies a varlena column of the slot, detoasted, into cxt; NULL when NULL. */
static struct varlena *
slot_varlena(TupleTableSlot *slot, AttrNumber attnum, MemoryContext cxt)
{
	bool		isnull;
	Datum		value = slot_getattr(slot, attnum, &isnull);
	MemoryContext old;
	struct varlena *copy;

	if (isnull)
		return NULL;
	old = MemoryContextSwitchTo(cxt);
	copy = PG_DETOAST_DATUM_COPY(value);
	MemoryContextSwitchTo(old);
	return copy;
}

/*
 * Ranks a record for the caller: 0 its own live record, 1 a live one of a
 * role whose privileges it has, 2 its own expired one, 3 another's expired
 * one; -1 a record it does not see.  Claim decides on the lowest rank.
 */
static int
record_rank(const KeysCatalog *c, TupleTableSlot *slot, Oid caller, TimestampTz now)
{
	Oid			owner = DatumGetObjectId(slot_col(slot, c->owner));
	bool		own = (owner == caller);
	bool		completed;
	bool		isnull;
	Datum		lease_end;
	bool		expired;

	if (!own && !has_privs_of_role(caller, owner))
		return -1;
	completed = DatumGetObjectId(slot_col(slot, c->state)) == c->completed_label;
	lease_end = slot_getattr(slot, c->lease_expires_at, &isnull);
	expired = DatumGetTimestampTz(slot_col(slot, c->expires_at)) <= now &&
		(completed || isnull || DatumGetTimestampTz(lease_end) <= now);
	return (expired ? 2 : 0) + (own ? 0 : 1);
}

/* Fills rec from the record in slot; the response too when claim will replay it. */
static void
read_record(const KeysCatalog *c, TupleTableSlot *slot, bytea *fingerprint,
			MemoryContext cxt, IdemRecord *rec)
{
	bytea	   *stored = DatumGetByteaPP(slot_col(slot, c->fingerprint));
	bool		isnull;
	Datum		lease_end = slot_getattr(slot, c->lease_expires_at, &isnull);

	rec->owner = DatumGetObjectId(slot_col(slot, c->owner));
	rec->fence = DatumGetInt64(slot_col(slot, c->fence));
	rec->completed = DatumGetObjectId(slot_col(slot, c->state)) == c->completed_label;
	rec->same_fingerprint =
		VARSIZE_ANY_EXHDR(stored) == VARSIZE_ANY_EXHDR(fingerprint) &&
		memcmp(VARDATA_ANY(stored), VARDATA_ANY(fingerprint),
			   VARSIZE_ANY_EXHDR(stored)) == 0;
	rec->lease_expires_at = isnull ? DT_NOBEGIN : DatumGetTimestampTz(lease_end);
	rec->expires_at = DatumGetTimestampTz(slot_col(slot, c->expires_at));
	rec->created_at = DatumGetTimestampTz(slot_col(slot, c->created_at));
	rec->headers = NULL;
	rec->body = NULL;
	if (rec->completed && rec->same_fingerprint)
	{
		rec->status_code = DatumGetInt32(slot_col(slot, c->status_code));
		rec->headers = (Jsonb *) slot_varlena(slot, c->headers, cxt);
		rec->body = (bytea *) slot_varlena(slot, c->body, cxt);
	}
}

/*
 * Reads the record of (scope, key) that the caller sees into rec (its own
 * first, live before expired at now); false when there is none.  A plain index lookup through the
 * primary key with a new snapshot, as a READ COMMITTED statement would take:
 * this is the hottest read of the API, so it does without the executor.
 * Nearly always one record matches, the caller's own, and the scan stops.
 */
bool
idem_keys_fetch(IdemCall *call, text *scope, text *key, bytea *fingerprint,
				TimestampTz now, IdemRecord *rec)
{
	const KeysCatalog *c = get_catalog();
	Relation	rel;
	Relation	index;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	TupleTableSlot *best = NULL;
	int			best_rank = -1;
	Snapshot	snapshot;

	/*
	 * A new snapshot, not the statement's: a claim that lost a race must see
	 * the winner's commit, and a second claim in one statement the first's
	 * insert (SPI has advanced the command counter after it).
	 */
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	rel = table_open(c->keys_relid, AccessShareLock);
	index = index_open(RelationGetPrimaryKeyIndex(rel), AccessShareLock);
	ScanKeyEntryInitialize(&skey[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(scope));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(key));
	slot = table_slot_create(rel, NULL);
	scan = index_beginscan(rel, index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);

	while (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		int			rank = record_rank(c, slot, call->caller, now);

		if (rank < 0 || (best_rank >= 0 && rank >= best_rank))
			continue;
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
		read_record(c, best, fingerprint, call->caller_cxt, rec);

	index_endscan(scan);
	if (best && best != slot)
		ExecDropSingleTupleTableSlot(best);
	ExecDropSingleTupleTableSlot(slot);
	index_close(index, AccessShareLock);
	table_close(rel, AccessShareLock);
	UnregisterSnapshot(snapshot);
	return best != NULL;
}

/*
 * Inserts a new claim owned by owner, unless a record of (scope, key, owner)
 * exists; returns whether it did, and its fence.  The caller holds the key
 * lock.
 */
bool
idem_keys_insert(text *scope, text *key, Oid owner, bytea *fingerprint,
				 Interval *lease, Interval *retention, TimestampTz now, int64 *fence)
{
	Datum		values[7] = {PointerGetDatum(scope), PointerGetDatum(key),
		ObjectIdGetDatum(owner), PointerGetDatum(fingerprint), IntervalPGetDatum(lease),
	IntervalPGetDatum(retention), TimestampTzGetDatum(now)};
	bool		isnull;

	lock_key(scope, key);
	if (run_plan(PLAN_INSERT, values, NULL, false) != 1)
		return false;
	*fence = DatumGetInt64(result_col(1, &isnull));
	return true;
}

/*
 * Makes owner's expired record of (scope, key) a new claim; returns whether
 * it was still expired, and the new fence.
 */
bool
idem_keys_reset(text *scope, text *key, Oid owner, bytea *fingerprint,
				Interval *lease, Interval *retention, TimestampTz now, int64 *fence)
{
	Datum		values[7] = {PointerGetDatum(scope), PointerGetDatum(key),
		ObjectIdGetDatum(owner), PointerGetDatum(fingerprint), IntervalPGetDatum(lease),
	IntervalPGetDatum(retention), TimestampTzGetDatum(now)};
	bool		isnull;

	lock_key(scope, key);
	if (run_plan(PLAN_RESET, values, NULL, false) != 1)
		return false;
	*fence = DatumGetInt64(result_col(1, &isnull));
	return true;
}

/*
 * Takes over the claim that fence held, if its lease has still ended and
 * it is still that fence's: a new fence, one more attempt, the recovery
 * point kept.  Returns whether it did.
 */
bool
idem_keys_takeover(IdemCall *call, text *scope, text *key, Oid owner, int64 fence,
				   Interval *lease, TimestampTz now, IdemTakeover *result)
{
	Datum		values[6] = {PointerGetDatum(scope), PointerGetDatum(key),
		ObjectIdGetDatum(owner), Int64GetDatum(fence), IntervalPGetDatum(lease),
	TimestampTzGetDatum(now)};
	bool		isnull;

	lock_key(scope, key);
	if (run_plan(PLAN_TAKEOVER, values, NULL, false) != 1)
		return false;
	result->fence = DatumGetInt64(result_col(1, &isnull));
	result->attempt = DatumGetInt32(result_col(2, &isnull));
	result->recovery_point = (text *) result_varlena(3, call->caller_cxt);
	result->recovery_state = (Jsonb *) result_varlena(4, call->caller_cxt);
	result->created_at = DatumGetTimestampTz(result_col(5, &isnull));
	return true;
}

/*
 * Makes the fence just handed out durable before anyone sees it.
 *
 * A sequence is WAL-logged once per 32 values, and that record is flushed
 * only by some later commit.  Should the server crash before then, the
 * sequence would restart below a fence already given to a client whose claim
 * never committed, and hand that fence out again: the old client's complete
 * would then succeed on the new owner's claim.  Flushing up to the sequence
 * page's LSN costs nothing when that record is already on disk (31 claims in
 * 32), and one WAL flush otherwise.  Call it after idem_call_end.
 */
void
idem_keys_flush_fence(void)
{
	Relation	seqrel = relation_open(get_catalog()->fence_seq_relid, AccessShareLock);
	Buffer		buf = ReadBuffer(seqrel, 0);
	XLogRecPtr	lsn;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	lsn = PageGetLSN(BufferGetPage(buf));
	UnlockReleaseBuffer(buf);
	relation_close(seqrel, AccessShareLock);
	XLogFlush(lsn);
}

/* Stores the response if this fence owns the claim and the caller sees it. */
bool
idem_keys_complete(IdemCall *call, text *scope, text *key, int64 fence, int32 status_code,
				   Jsonb *headers, bytea *body, TimestampTz now)
{
	Datum		values[8] = {PointerGetDatum(scope), PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), Int32GetDatum(status_code),
	PointerGetDatum(headers), PointerGetDatum(body), TimestampTzGetDatum(now)};
	char		nulls[8] = {' ', ' ', ' ', ' ', ' ', headers ? ' ' : 'n', body ? ' ' : 'n', ' '};

	lock_key(scope, key);
	return run_plan(PLAN_COMPLETE, values, nulls, false) == 1;
}

/* Deletes the claim if this fence owns it and the caller sees it. */
bool
idem_keys_release(IdemCall *call, text *scope, text *key, int64 fence)
{
	Datum		values[4] = {PointerGetDatum(scope), PointerGetDatum(key),
	Int64GetDatum(fence), ObjectIdGetDatum(call->caller)};

	lock_key(scope, key);
	return run_plan(PLAN_RELEASE, values, NULL, false) == 1;
}

/*
 * Renews the lease by lease (NULL: the claim's own length) from now, never
 * shortening it; sets *ends to its end.  False when the fence lost the claim.
 */
bool
idem_keys_extend(IdemCall *call, text *scope, text *key, int64 fence, Interval *lease,
				 TimestampTz now, TimestampTz *ends)
{
	Datum		values[6] = {PointerGetDatum(scope), PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), PointerGetDatum(lease),
	TimestampTzGetDatum(now)};
	char		nulls[6] = {' ', ' ', ' ', ' ', lease ? ' ' : 'n', ' '};
	bool		isnull;

	lock_key(scope, key);
	if (run_plan(PLAN_EXTEND, values, nulls, false) != 1)
		return false;
	*ends = DatumGetTimestampTz(result_col(1, &isnull));
	return true;
}

/* Saves a recovery point and renews the lease; false when the fence lost the claim. */
bool
idem_keys_checkpoint(IdemCall *call, text *scope, text *key, int64 fence,
					 text *recovery_point, Jsonb *recovery_state, TimestampTz now)
{
	Datum		values[7] = {PointerGetDatum(scope), PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), PointerGetDatum(recovery_point),
	PointerGetDatum(recovery_state), TimestampTzGetDatum(now)};
	char		nulls[7] = {' ', ' ', ' ', ' ', ' ', recovery_state ? ' ' : 'n', ' '};

	lock_key(scope, key);
	return run_plan(PLAN_CHECKPOINT, values, nulls, false) == 1;
}

/*
 * Returns the record of (scope, key) the caller sees, as lookup() shows it,
 * copied into the caller's memory; NULL when there is none or it expired.
 */
HeapTuple
idem_keys_lookup(IdemCall *call, text *scope, text *key, TimestampTz now)
{
	Datum		values[4] = {PointerGetDatum(scope), PointerGetDatum(key),
	ObjectIdGetDatum(call->caller), TimestampTzGetDatum(now)};
	MemoryContext old;
	HeapTuple	tuple;

	if (run_plan(PLAN_LOOKUP, values, NULL, true) != 1)
		return NULL;
	old = MemoryContextSwitchTo(call->caller_cxt);
	tuple = heap_copytuple(SPI_tuptable->vals[0]);
	MemoryContextSwitchTo(old);
	return tuple;
}

/*
 * Deletes up to batch records expired at now, oldest first, skipping locked
 * ones; returns how many.  Used by reap() and by the background reaper.
 */
uint64
idem_keys_reap(int batch, TimestampTz now)
{
	Datum		values[2] = {TimestampTzGetDatum(now), Int32GetDatum(batch)};
	IdemCall	call;
	uint64		reaped;

	idem_call_begin(&call);
	reaped = run_plan(PLAN_REAP, values, NULL, false);
	idem_call_end(&call);
	return reaped;
}
