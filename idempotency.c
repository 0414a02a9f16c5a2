/*-------------------------------------------------------------------------
 * idempotency.c
 *	  The SQL-callable API of the idempotency extension and _PG_init.
 *
 * Records live in idempotency.keys, one row per (scope, key).  Every call
 * writes that table through SPI plans prepared once per backend, as the
 * table's owner: application roles get EXECUTE on the functions and no
 * privilege on the table.  Every name in the plans is schema-qualified,
 * operators included, so the caller's search_path cannot change their
 * meaning.  The one read on the hot path, claim's, is a direct primary-key
 * lookup instead, without an executor: it took replays from 0.68x to 0.95x
 * a bare primary-key SELECT (bench/run).
 *
 * The claim is decided by a plain read, then at most one conditional write:
 * INSERT ... ON CONFLICT DO NOTHING for an absent key, or an UPDATE whose
 * WHERE clause repeats the condition for a takeover or an expired record.
 * PostgreSQL re-checks that condition on the newest row version, so of any
 * number of concurrent claims exactly one write succeeds; the losers read
 * again and answer from what committed.  Replays, mismatches and in_progress
 * answers write nothing.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "access/detoast.h"
#include "access/htup_details.h"
#include "access/genam.h"
#include "access/relation.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_enum.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "portability/instr_time.h"
#include "miscadmin.h"
#include "storage/bufmgr.h"
#include "storage/ipc.h"
#include "tcop/utility.h"
#include "executor/tuptable.h"
#include "parser/parse_relation.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/datum.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "compat.h"
#include "idempotency.h"

PG_MODULE_MAGIC;

/* SQLSTATE IK001: the fence no longer owns the claim. */
#define ERRCODE_FENCE_LOST MAKE_SQLSTATE('I','K','0','0','1')

#define MAX_KEY_BYTES 255
#define MAX_SCOPE_BYTES 255
#define MAX_FINGERPRINT_BYTES 64

/* A claim that keeps losing races to concurrent writers gives up with 40001. */
#define CLAIM_MAX_TRIES 16

/* Longest single sleep of a waiting claim: a safety net for missed wake-ups. */
#define WAIT_MAX_SLEEP_MS 1000

/* Settings: see _PG_init for what each is for. */
int			idem_lease_ms = 60000;
int			idem_retention_s = 86400;
char	   *idem_scope = NULL;
int			idem_max_response_bytes = 1024 * 1024;
bool		idem_store_server_errors = false;
char	   *idem_header_denylist = NULL;
int			idem_reaper_naptime_s = 60;
int			idem_reaper_batch = 10000;
char	   *idem_reaper_databases = NULL;

#ifdef IDEM_HAVE_SHMEM_REQUEST_HOOK
static shmem_request_hook_type prev_shmem_request_hook = NULL;
#endif
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*
 * The plans.  Operators are written OPERATOR(pg_catalog.x): the plans run as
 * the table's owner, and an operator found through the caller's search_path
 * would run with the owner's rights.
 */
#define EQ " OPERATOR(pg_catalog.=) "
#define LE " OPERATOR(pg_catalog.<=) "
#define PLUS " OPERATOR(pg_catalog.+) "
#define KEY_IS "scope" EQ "$1 AND key" EQ "$2"
#define IN_PROGRESS "'in_progress'::idempotency.state"
#define COMPLETED "'completed'::idempotency.state"
#define NEXT_FENCE "pg_catalog.nextval('idempotency.fence_seq'::pg_catalog.regclass)"
#define OWNED_BY_FENCE KEY_IS " AND fence" EQ "$3 AND state" EQ IN_PROGRESS
/* The records that claim treats as absent and reap may delete, at time $N. */
#define EXPIRED_AT(n) "expires_at" LE n " AND (state" EQ COMPLETED " OR lease_expires_at" LE n ")"

typedef enum PlanId
{
	PLAN_INSERT,
	PLAN_TAKEOVER,
	PLAN_RESET,
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
	Oid			argtypes[7];
} PlanDef;

static const PlanDef plan_defs[NUM_PLANS] = {
	[PLAN_INSERT] = {
		"INSERT INTO idempotency.keys (scope, key, fingerprint, state, fence, attempt,"
		" lease, lease_expires_at, created_at, expires_at)"
		" VALUES ($1, $2, $3, " IN_PROGRESS ", " NEXT_FENCE ", 1, $4, $6" PLUS "$4,"
		" $6, $6" PLUS "$5)"
		" ON CONFLICT (scope, key) DO NOTHING RETURNING fence",
		6, {TEXTOID, TEXTOID, BYTEAOID, INTERVALOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_TAKEOVER] = {
		"UPDATE idempotency.keys SET fence = " NEXT_FENCE ", attempt = attempt" PLUS "1,"
		" lease = $4, lease_expires_at = $5" PLUS "$4"
		" WHERE " OWNED_BY_FENCE " AND lease_expires_at" LE "$5"
		" AND NOT (" EXPIRED_AT("$5") ")"
		" RETURNING fence, attempt, recovery_point, recovery_state, created_at",
		5, {TEXTOID, TEXTOID, INT8OID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_RESET] = {
		"UPDATE idempotency.keys SET fingerprint = $3, state = " IN_PROGRESS ","
		" fence = " NEXT_FENCE ", attempt = 1, lease = $4, lease_expires_at = $6" PLUS "$4,"
		" recovery_point = NULL, recovery_state = NULL, status_code = NULL,"
		" headers = NULL, body = NULL, created_at = $6, completed_at = NULL,"
		" expires_at = $6" PLUS "$5"
		" WHERE " KEY_IS " AND " EXPIRED_AT("$6") " RETURNING fence",
		6, {TEXTOID, TEXTOID, BYTEAOID, INTERVALOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_COMPLETE] = {
		"UPDATE idempotency.keys SET state = " COMPLETED ", status_code = $4,"
		" headers = $5, body = $6, completed_at = $7, lease_expires_at = NULL"
		" WHERE " OWNED_BY_FENCE,
		7, {TEXTOID, TEXTOID, INT8OID, INT4OID, JSONBOID, BYTEAOID, TIMESTAMPTZOID}
	},
	[PLAN_RELEASE] = {
		"DELETE FROM idempotency.keys WHERE " OWNED_BY_FENCE,
		3, {TEXTOID, TEXTOID, INT8OID}
	},
	[PLAN_EXTEND] = {
		"UPDATE idempotency.keys SET lease_expires_at ="
		" GREATEST(lease_expires_at, $5" PLUS "COALESCE($4, lease))"
		" WHERE " OWNED_BY_FENCE " RETURNING lease_expires_at",
		5, {TEXTOID, TEXTOID, INT8OID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_CHECKPOINT] = {
		"UPDATE idempotency.keys SET recovery_point = $4, recovery_state = $5,"
		" lease_expires_at = GREATEST(lease_expires_at, $6" PLUS "lease)"
		" WHERE " OWNED_BY_FENCE,
		6, {TEXTOID, TEXTOID, INT8OID, TEXTOID, JSONBOID, TIMESTAMPTZOID}
	},
	[PLAN_LOOKUP] = {
		"SELECT scope, key, fingerprint, state::pg_catalog.text, attempt, lease,"
		" lease_expires_at, recovery_point, recovery_state, status_code, headers,"
		" body, created_at, completed_at, expires_at FROM idempotency.keys"
		" WHERE " KEY_IS " AND NOT (" EXPIRED_AT("$3") ")",
		3, {TEXTOID, TEXTOID, TIMESTAMPTZOID}
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
	Oid			keys_relid;
	Oid			fence_seq_relid;
	Oid			owner;
	Oid			completed_label;	/* the enum value 'completed' */
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

static KeysCatalog keys_catalog;
static bool keys_catalog_valid = false;

/* What a call saved to be restored when it leaves SPI. */
typedef struct ApiCall
{
	Oid			save_userid;
	int			save_sec_context;
	MemoryContext caller_cxt;
} ApiCall;

/* The outcomes of claim, and the columns of its result row. */
typedef enum ClaimOutcome
{
	CLAIM_NEW,
	CLAIM_REPLAY,
	CLAIM_IN_PROGRESS,
	CLAIM_MISMATCH
} ClaimOutcome;

static const char *const outcome_names[] = {"new", "replay", "in_progress", "mismatch"};

enum
{
	OUT_OUTCOME, OUT_FENCE, OUT_ATTEMPT, OUT_STATUS_CODE, OUT_HEADERS, OUT_BODY,
	OUT_RECOVERY_POINT, OUT_RECOVERY_STATE, OUT_RETRY_AFTER, OUT_CREATED_AT,
	NUM_OUT
};

typedef struct ClaimArgs
{
	text	   *scope;
	text	   *key;
	bytea	   *fingerprint;
	Interval   *lease;
	Interval   *retention;
	uint32		keyhash;
} ClaimArgs;

typedef struct ClaimResult
{
	ClaimOutcome outcome;
	bool		takeover;
	TimestampTz lease_expires_at;	/* for in_progress */
	Datum		values[NUM_OUT];
	bool		nulls[NUM_OUT];
} ClaimResult;

PG_FUNCTION_INFO_V1(idempotency_claim);
PG_FUNCTION_INFO_V1(idempotency_complete);
PG_FUNCTION_INFO_V1(idempotency_release);
PG_FUNCTION_INFO_V1(idempotency_extend);
PG_FUNCTION_INFO_V1(idempotency_checkpoint);
PG_FUNCTION_INFO_V1(idempotency_lookup);
PG_FUNCTION_INFO_V1(idempotency_reap);

void		_PG_init(void);

/* ---------------------------------------------------------------------------
 * Settings and shared memory
 * ---------------------------------------------------------------------------
 */

#ifdef IDEM_HAVE_SHMEM_REQUEST_HOOK
/* Requests shared memory at postmaster start (PG 15+). */
static void
idem_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	stats_shmem_request();
}
#endif

/* Creates or attaches to the shared memory. */
static void
idem_shmem_startup(void)
{
	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	stats_shmem_startup();
}

/* Defines the settings and, when preloaded, shared memory and the reaper. */
void
_PG_init(void)
{
	/*
	 * A lease is how long an owner that stops answering is presumed alive:
	 * long enough for the slowest handler, short enough that a retry after a
	 * crash is not kept waiting.  Milliseconds, so that tests can use short
	 * ones.
	 */
	DefineCustomIntVariable("idempotency.lease",
							"Default lease of a claim.",
							"After this long without complete, release, extend or checkpoint, a retry may take the claim over.",
							&idem_lease_ms, 60 * 1000, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS, NULL, NULL, NULL);

	/*
	 * Retention is how long a record answers retries.  Seconds, because
	 * records are often kept for days or weeks.
	 */
	DefineCustomIntVariable("idempotency.retention",
							"Default time a record is kept, counted from its creation.",
							NULL,
							&idem_retention_s, 24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S, NULL, NULL, NULL);

	/* An auth layer sets the scope once per request with SET LOCAL. */
	DefineCustomStringVariable("idempotency.scope",
							   "Scope of keys for calls that name none.",
							   "Set it per request, e.g. SET LOCAL idempotency.scope = 'acct_42'.",
							   &idem_scope, "",
							   PGC_USERSET, 0, NULL, NULL, NULL);

	/* Stored responses live in the table and in the WAL: keep them bounded. */
	DefineCustomIntVariable("idempotency.max_response_bytes",
							"Largest response body that complete stores.",
							NULL,
							&idem_max_response_bytes, 1024 * 1024, 0, 1024 * 1024 * 1024,
							PGC_USERSET, GUC_UNIT_BYTE, NULL, NULL, NULL);

	/* A 5xx is usually transient: by default the retry runs again. */
	DefineCustomBoolVariable("idempotency.store_server_errors",
							 "Stores 5xx responses for replay instead of releasing the claim.",
							 NULL,
							 &idem_store_server_errors, false,
							 PGC_USERSET, 0, NULL, NULL, NULL);

	/* Credentials and session cookies must never be replayed to anyone. */
	DefineCustomStringVariable("idempotency.header_denylist",
							   "Response headers that complete never stores.",
							   "A comma-separated list of header names, case-insensitive; empty stores every header.",
							   &idem_header_denylist,
							   "set-cookie, authorization, proxy-authorization, cookie, www-authenticate",
							   PGC_USERSET, GUC_LIST_INPUT, NULL, NULL, NULL);

	/* The reaper's rhythm: expiry is not urgent, a minute is plenty. */
	DefineCustomIntVariable("idempotency.reaper_naptime",
							"Time between runs of the background reaper.",
							NULL,
							&idem_reaper_naptime_s, 60, 1, INT_MAX / 1000,
							PGC_SIGHUP, GUC_UNIT_S, NULL, NULL, NULL);

	/* One transaction per batch keeps locks and WAL bursts small. */
	DefineCustomIntVariable("idempotency.reaper_batch",
							"Records deleted per transaction by the reaper, and by reap() by default.",
							NULL,
							&idem_reaper_batch, 10000, 1, INT_MAX,
							PGC_SIGHUP, 0, NULL, NULL, NULL);

	DefineCustomStringVariable("idempotency.reaper_databases",
							   "Databases the reaper visits.",
							   "A comma-separated list; empty means every database where the extension is installed.",
							   &idem_reaper_databases, "",
							   PGC_SIGHUP, GUC_LIST_INPUT, NULL, NULL, NULL);

	MarkGUCPrefixReserved("idempotency");

	if (!process_shared_preload_libraries_in_progress)
		return;

#ifdef IDEM_HAVE_SHMEM_REQUEST_HOOK
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = idem_shmem_request;
#else
	stats_shmem_request();
#endif
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = idem_shmem_startup;

	reaper_register();
}

/* ---------------------------------------------------------------------------
 * Arguments
 * ---------------------------------------------------------------------------
 */

/* Raises 22004 when argument argno, named name, is NULL. */
void
require_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", name)));
}

/* Tells whether s holds a control character (C0, DEL, or C1 in UTF-8). */
static bool
has_control_chars(const unsigned char *s, int len)
{
	bool		utf8 = (GetDatabaseEncoding() == PG_UTF8);

	for (int i = 0; i < len; i++)
	{
		if (s[i] < 0x20 || s[i] == 0x7f)
			return true;
		if (utf8 && s[i] == 0xc2 && i + 1 < len && s[i + 1] >= 0x80 && s[i + 1] <= 0x9f)
			return true;
	}
	return false;
}

/* Checks a key or scope: length in bytes and no control characters. */
static void
check_name(text *t, const char *what, int min_len, int max_len)
{
	int			len = VARSIZE_ANY_EXHDR(t);

	if (len < min_len || len > max_len)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid %s", what),
				 errdetail("The %s must be %d to %d bytes long; it has %d.",
						   what, min_len, max_len, len)));
	if (has_control_chars((const unsigned char *) VARDATA_ANY(t), len))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid %s", what),
				 errdetail("The %s must not contain control characters.", what)));
}

/* Returns the key argument, checked. */
static text *
get_key(FunctionCallInfo fcinfo, int argno)
{
	text	   *key;

	require_arg(fcinfo, argno, "key");
	key = PG_GETARG_TEXT_PP(argno);
	check_name(key, "idempotency key", 1, MAX_KEY_BYTES);
	return key;
}

/* Returns the scope argument, or the setting idempotency.scope when NULL. */
static text *
get_scope(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope;

	if (PG_ARGISNULL(argno))
		scope = cstring_to_text(idem_scope ? idem_scope : "");
	else
		scope = PG_GETARG_TEXT_PP(argno);
	check_name(scope, "scope", 0, MAX_SCOPE_BYTES);
	return scope;
}

/* Returns the fence argument. */
static int64
get_fence(FunctionCallInfo fcinfo, int argno)
{
	require_arg(fcinfo, argno, "fence");
	return PG_GETARG_INT64(argno);
}

/* Approximates an interval in microseconds, as interval comparison does. */
static double
interval_usecs(const Interval *span)
{
	return (double) span->time + (double) span->day * USECS_PER_DAY +
		(double) span->month * DAYS_PER_MONTH * USECS_PER_DAY;
}

/*
 * Returns an interval argument, or default_ms milliseconds when NULL (or
 * NULL itself when default_ms is negative).  It must be positive, or, when
 * zero_ok, not negative.
 */
static Interval *
get_interval(FunctionCallInfo fcinfo, int argno, const char *name,
			 int64 default_ms, bool zero_ok)
{
	Interval   *span;

	if (PG_ARGISNULL(argno))
	{
		if (default_ms < 0)
			return NULL;
		span = palloc0(sizeof(Interval));
		span->time = default_ms * 1000;
		return span;
	}
	span = PG_GETARG_INTERVAL_P(argno);
	if (zero_ok ? interval_usecs(span) < 0 : interval_usecs(span) <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg(zero_ok ? "%s must not be negative" : "%s must be positive",
						name)));
	return span;
}

/* Hashes (scope, key) onto the slot where claims waiting for it sleep. */
static uint32
key_hash(text *scope, text *key)
{
	uint32		h = hash_bytes((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key));

	return hash_combine(h, hash_bytes((const unsigned char *) VARDATA_ANY(scope),
									  VARSIZE_ANY_EXHDR(scope)));
}

/* ---------------------------------------------------------------------------
 * SPI, as the owner of the table
 * ---------------------------------------------------------------------------
 */

/* Forgets the cached catalog facts when the table's relcache entry goes. */
static void
keys_catalog_invalidate(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == keys_catalog.keys_relid ||
		relid == keys_catalog.fence_seq_relid)
		keys_catalog_valid = false;
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
get_keys_catalog(void)
{
	static bool callback_registered = false;
	KeysCatalog *c = &keys_catalog;
	Oid			nsp;
	Relation	rel;

	if (keys_catalog_valid)
		return c;

	nsp = get_namespace_oid("idempotency", false);
	c->keys_relid = get_relname_relid("keys", nsp);
	c->fence_seq_relid = get_relname_relid("fence_seq", nsp);
	if (!OidIsValid(c->keys_relid) || !OidIsValid(c->fence_seq_relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"idempotency.keys\" does not exist"),
				 errhint("Run CREATE EXTENSION idempotency.")));

	rel = table_open(c->keys_relid, AccessShareLock);
	c->owner = rel->rd_rel->relowner;
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

	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(keys_catalog_invalidate, (Datum) 0);
		callback_registered = true;
	}
	keys_catalog_valid = true;
	return c;
}

/*
 * Connects to SPI as the table's owner.  An error before api_end needs no
 * cleanup: (sub)transaction abort restores the user and closes SPI.
 */
static void
api_begin(ApiCall *call)
{
	Oid			owner = get_keys_catalog()->owner;

	call->caller_cxt = CurrentMemoryContext;
	GetUserIdAndSecContext(&call->save_userid, &call->save_sec_context);
	SetUserIdAndSecContext(owner, call->save_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
}

/* Leaves SPI and returns to the caller's user. */
static void
api_end(ApiCall *call)
{
	SPI_finish();
	SetUserIdAndSecContext(call->save_userid, call->save_sec_context);
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

/* Returns column n of the first result row, detoasted and copied for the caller. */
static Datum
result_col_copy(ApiCall *call, int n, bool *isnull)
{
	Datum		value = result_col(n, isnull);
	Form_pg_attribute attr = TupleDescAttr(SPI_tuptable->tupdesc, n - 1);
	MemoryContext old;

	if (*isnull || attr->attbyval)
		return value;
	old = MemoryContextSwitchTo(call->caller_cxt);
	if (attr->attlen == -1)
		value = PointerGetDatum(PG_DETOAST_DATUM_COPY(value));
	else
		value = datumCopy(value, false, attr->attlen);
	MemoryContextSwitchTo(old);
	return value;
}

/* Returns the first result row's column n, a timestamptz that is not NULL. */
static TimestampTz
result_timestamp(int n)
{
	bool		isnull;
	Datum		value = result_col(n, &isnull);

	return isnull ? DT_NOBEGIN : DatumGetTimestampTz(value);
}

/* Raises IK001: the fence no longer owns the claim. */
static void
fence_lost(text *key)
{
	stats_add(IDEM_FENCE_REJECTIONS, 1);
	ereport(ERROR,
			(errcode(ERRCODE_FENCE_LOST),
			 errmsg("this fence no longer owns idempotency key \"%s\"",
					text_to_cstring(key)),
			 errdetail("The claim was taken over, released, completed or expired."),
			 errhint("Do not send this response: another attempt owns the request.")));
}

/* ---------------------------------------------------------------------------
 * claim
 * ---------------------------------------------------------------------------
 */

/*
 * Makes the fence just handed out durable before anyone sees it.
 *
 * A sequence is WAL-logged once per 32 values, and that record is flushed
 * only by some later commit.  Should the server crash before then, the
 * sequence would restart below a fence already given to a client whose claim
 * never committed, and hand that fence out again: the old client's complete
 * would then succeed on the new owner's claim.  Flushing up to the sequence
 * page's LSN costs nothing when that record is already on disk (31 claims in
 * 32), and one WAL flush otherwise.  With synchronous_commit off the caller
 * has chosen to lose the last commits in a crash, fences included, and
 * pays no flush.
 */
static void
flush_fence_sequence(void)
{
	Relation	seqrel = relation_open(keys_catalog.fence_seq_relid, AccessShareLock);
	Buffer		buf = ReadBuffer(seqrel, 0);
	XLogRecPtr	lsn;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	lsn = PageGetLSN(BufferGetPage(buf));
	UnlockReleaseBuffer(buf);
	relation_close(seqrel, AccessShareLock);
	XLogFlush(lsn);
}

/* Fills the result of a successful claim from the columns the write returned. */
static void
set_new(ClaimResult *r, ApiCall *call, bool takeover, TimestampTz now)
{
	bool		isnull;

	r->outcome = CLAIM_NEW;
	r->takeover = takeover;
	r->values[OUT_FENCE] = result_col(1, &isnull);
	r->nulls[OUT_FENCE] = false;
	if (takeover)
	{
		r->values[OUT_ATTEMPT] = result_col(2, &isnull);
		r->values[OUT_RECOVERY_POINT] = result_col_copy(call, 3, &r->nulls[OUT_RECOVERY_POINT]);
		r->values[OUT_RECOVERY_STATE] = result_col_copy(call, 4, &r->nulls[OUT_RECOVERY_STATE]);
		r->values[OUT_CREATED_AT] = result_col(5, &isnull);
	}
	else
	{
		r->values[OUT_ATTEMPT] = Int32GetDatum(1);
		r->values[OUT_CREATED_AT] = TimestampTzGetDatum(now);
	}
	r->nulls[OUT_ATTEMPT] = false;
	r->nulls[OUT_CREATED_AT] = false;
}

/* What claim reads of a record: the columns it decides and answers on. */
typedef struct StoredRecord
{
	int64		fence;
	bool		completed;
	bool		same_fingerprint;
	TimestampTz lease_expires_at;	/* DT_NOBEGIN when NULL (completed) */
	TimestampTz expires_at;
	TimestampTz created_at;
} StoredRecord;

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

/* Copies a varlena column of the slot, detoasted, for the caller; NULL stays NULL. */
static Datum
slot_col_copy(TupleTableSlot *slot, AttrNumber attnum, ApiCall *call, bool *isnull)
{
	Datum		value = slot_getattr(slot, attnum, isnull);
	MemoryContext old;

	if (*isnull)
		return (Datum) 0;
	old = MemoryContextSwitchTo(call->caller_cxt);
	value = PointerGetDatum(PG_DETOAST_DATUM_COPY(value));
	MemoryContextSwitchTo(old);
	return value;
}

/*
 * Reads the record of the claim's (scope, key) into rec, and for a completed
 * one with the same fingerprint its response into r; false when there is
 * none.  A plain index lookup through the primary key with a new snapshot,
 * as a READ COMMITTED statement would take: this is the hottest read of the
 * API, so it does without the executor.
 */
static bool
fetch_record(const ClaimArgs *a, ApiCall *call, StoredRecord *rec, ClaimResult *r)
{
	const KeysCatalog *c = get_keys_catalog();
	Relation	rel;
	Relation	index;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	Snapshot	snapshot;
	bool		found;

	/*
	 * A new snapshot, not the statement's: a claim that lost a race must see
	 * the winner's commit, and a second claim in one statement the first's
	 * insert (SPI has advanced the command counter after it).
	 */
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	rel = table_open(c->keys_relid, AccessShareLock);
	index = index_open(RelationGetPrimaryKeyIndex(rel), AccessShareLock);
	ScanKeyEntryInitialize(&skey[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(a->scope));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(a->key));
	slot = table_slot_create(rel, NULL);
	scan = index_beginscan(rel, index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);

	found = index_getnext_slot(scan, ForwardScanDirection, slot);
	if (found)
	{
		bytea	   *stored = DatumGetByteaPP(slot_col(slot, c->fingerprint));
		bool		isnull;
		Datum		lease_end = slot_getattr(slot, c->lease_expires_at, &isnull);

		rec->fence = DatumGetInt64(slot_col(slot, c->fence));
		rec->completed = DatumGetObjectId(slot_col(slot, c->state)) == c->completed_label;
		rec->same_fingerprint =
			VARSIZE_ANY_EXHDR(stored) == VARSIZE_ANY_EXHDR(a->fingerprint) &&
			memcmp(VARDATA_ANY(stored), VARDATA_ANY(a->fingerprint),
				   VARSIZE_ANY_EXHDR(stored)) == 0;
		rec->lease_expires_at = isnull ? DT_NOBEGIN : DatumGetTimestampTz(lease_end);
		rec->expires_at = DatumGetTimestampTz(slot_col(slot, c->expires_at));
		rec->created_at = DatumGetTimestampTz(slot_col(slot, c->created_at));
		if (rec->completed && rec->same_fingerprint)
		{
			r->values[OUT_STATUS_CODE] = slot_getattr(slot, c->status_code,
													  &r->nulls[OUT_STATUS_CODE]);
			r->values[OUT_HEADERS] = slot_col_copy(slot, c->headers, call, &r->nulls[OUT_HEADERS]);
			r->values[OUT_BODY] = slot_col_copy(slot, c->body, call, &r->nulls[OUT_BODY]);
		}
	}

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	index_close(index, AccessShareLock);
	table_close(rel, AccessShareLock);
	UnregisterSnapshot(snapshot);
	return found;
}

/*
 * Decides one claim at time now, in the order of the design: expired counts
 * as absent; a different fingerprint is a mismatch; completed is a replay; a
 * live lease is in_progress; an ended lease is a takeover.  A write that a
 * concurrent transaction made moot sends us round again.
 */
static void
claim_once(const ClaimArgs *a, ApiCall *call, TimestampTz now, ClaimResult *r)
{
	Datum		values[6] = {PointerGetDatum(a->scope), PointerGetDatum(a->key),
		PointerGetDatum(a->fingerprint), IntervalPGetDatum(a->lease),
	IntervalPGetDatum(a->retention), TimestampTzGetDatum(now)};

	for (int tries = 0; tries < CLAIM_MAX_TRIES; tries++)
	{
		StoredRecord rec;

		memset(r->nulls, true, sizeof(r->nulls));
		r->takeover = false;

		if (!fetch_record(a, call, &rec, r))
		{
			if (run_plan(PLAN_INSERT, values, NULL, false) == 1)
			{
				set_new(r, call, false, now);
				return;
			}
			continue;			/* a concurrent claim committed first */
		}

		r->values[OUT_CREATED_AT] = TimestampTzGetDatum(rec.created_at);
		r->nulls[OUT_CREATED_AT] = false;

		if (rec.expires_at <= now && (rec.completed || rec.lease_expires_at <= now))
		{
			if (run_plan(PLAN_RESET, values, NULL, false) == 1)
			{
				set_new(r, call, false, now);
				return;
			}
			continue;
		}
		if (!rec.same_fingerprint)
		{
			r->outcome = CLAIM_MISMATCH;
			return;
		}
		if (rec.completed)
		{
			r->outcome = CLAIM_REPLAY;
			return;
		}
		if (rec.lease_expires_at > now)
		{
			r->outcome = CLAIM_IN_PROGRESS;
			r->lease_expires_at = rec.lease_expires_at;
			return;
		}
		else
		{
			Datum		takeover[5] = {PointerGetDatum(a->scope), PointerGetDatum(a->key),
				Int64GetDatum(rec.fence), IntervalPGetDatum(a->lease),
			TimestampTzGetDatum(now)};

			if (run_plan(PLAN_TAKEOVER, takeover, NULL, false) == 1)
			{
				set_new(r, call, true, now);
				return;
			}
		}
	}
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not claim idempotency key \"%s\" because of concurrent updates",
					text_to_cstring(a->key)),
			 errhint("Retry the claim.")));
}

/* Whole seconds until the lease ends, at least 1. */
static int32
retry_after_seconds(TimestampTz lease_expires_at, TimestampTz now)
{
	int64		usecs = lease_expires_at - now;
	int64		secs = (usecs + USECS_PER_SEC - 1) / USECS_PER_SEC;

	return (int32) Max(1, Min(secs, PG_INT32_MAX));
}

/* Counts a claim's answer in the statistics. */
static void
count_claim(const ClaimResult *r, bool waited)
{
	static const IdemCounter counters[] = {
		IDEM_CLAIMS_NEW, IDEM_CLAIMS_REPLAY, IDEM_CLAIMS_IN_PROGRESS, IDEM_CLAIMS_MISMATCH
	};

	stats_add(counters[r->outcome], 1);
	if (r->takeover)
		stats_add(IDEM_TAKEOVERS, 1);
	if (waited)
		stats_add(IDEM_WAITS, 1);
}

/*
 * Returns claim's blessed result descriptor, built once per backend (per
 * function OID, so a recreated extension gets a new one).
 */
static TupleDesc
claim_result_desc(FunctionCallInfo fcinfo)
{
	static Oid	desc_fn_oid = InvalidOid;
	static TupleDesc desc = NULL;
	TupleDesc	tupdesc;
	MemoryContext old;

	if (desc && desc_fn_oid == fcinfo->flinfo->fn_oid)
		return desc;
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	old = MemoryContextSwitchTo(TopMemoryContext);
	tupdesc = BlessTupleDesc(CreateTupleDescCopy(tupdesc));
	MemoryContextSwitchTo(old);
	if (desc)
		FreeTupleDesc(desc);
	desc = tupdesc;
	desc_fn_oid = fcinfo->flinfo->fn_oid;
	return desc;
}

/*
 * claim(key, fingerprint, scope, lease, retention, wait): decides whether to
 * run a request; with wait, an in_progress answer first waits (on a condition
 * variable woken when complete or release commits, or until the lease ends)
 * for up to that long.
 */
Datum
idempotency_claim(PG_FUNCTION_ARGS)
{
	ClaimArgs	a;
	ClaimResult r;
	ApiCall		call;
	Interval   *wait;
	TupleDesc	tupdesc;
	TimestampTz now;
	double		wait_ms;
	instr_time	wait_start;
	instr_time	elapsed;
	bool		prepared = false;
	bool		waited = false;

	a.key = get_key(fcinfo, 0);
	require_arg(fcinfo, 1, "fingerprint");
	a.fingerprint = PG_GETARG_BYTEA_PP(1);
	if (VARSIZE_ANY_EXHDR(a.fingerprint) < 1 ||
		VARSIZE_ANY_EXHDR(a.fingerprint) > MAX_FINGERPRINT_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid fingerprint"),
				 errdetail("The fingerprint must be 1 to %d bytes long; it has %d.",
						   MAX_FINGERPRINT_BYTES, (int) VARSIZE_ANY_EXHDR(a.fingerprint))));
	a.scope = get_scope(fcinfo, 2);
	a.lease = get_interval(fcinfo, 3, "lease", idem_lease_ms, false);
	a.retention = get_interval(fcinfo, 4, "retention", (int64) idem_retention_s * 1000, false);
	wait = get_interval(fcinfo, 5, "wait", 0, true);
	a.keyhash = key_hash(a.scope, a.key);

	tupdesc = claim_result_desc(fcinfo);
	PreventCommandIfReadOnly("idempotency.claim()");

	now = GetCurrentTimestamp();
	/*
	 * The wait is measured on the monotonic clock, immune to clock steps.
	 * Under REPEATABLE READ or SERIALIZABLE the snapshot would hide the
	 * owner's complete or release, so such a claim answers at once.
	 */
	wait_ms = IsolationUsesXactSnapshot() ? 0 : interval_usecs(wait) / 1000.0;
	INSTR_TIME_SET_CURRENT(wait_start);

	api_begin(&call);
	for (;;)
	{
		double		left_ms;
		double		lease_ms;

		claim_once(&a, &call, now, &r);
		INSTR_TIME_SET_CURRENT(elapsed);
		INSTR_TIME_SUBTRACT(elapsed, wait_start);
		left_ms = wait_ms - INSTR_TIME_GET_MILLISEC(elapsed);
		if (r.outcome != CLAIM_IN_PROGRESS || left_ms <= 0)
			break;
		if (!prepared)
		{
			/* Look once more after registering, so no wake-up falls between. */
			wait_prepare(a.keyhash);
			prepared = true;
			continue;
		}
		lease_ms = (r.lease_expires_at - now) / 1000.0 + 1;
		(void) wait_sleep(a.keyhash, (long) Max(1, Min(Min(left_ms, lease_ms), WAIT_MAX_SLEEP_MS)));
		waited = true;
		now = GetCurrentTimestamp();
	}
	if (prepared)
		wait_cancel();
	api_end(&call);
	if (r.outcome == CLAIM_NEW && synchronous_commit > SYNCHRONOUS_COMMIT_OFF)
		flush_fence_sequence();

	if (r.outcome == CLAIM_IN_PROGRESS)
	{
		r.values[OUT_RETRY_AFTER] = Int32GetDatum(retry_after_seconds(r.lease_expires_at, now));
		r.nulls[OUT_RETRY_AFTER] = false;
	}
	r.values[OUT_OUTCOME] = CStringGetTextDatum(outcome_names[r.outcome]);
	r.nulls[OUT_OUTCOME] = false;
	count_claim(&r, waited);

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, r.values, r.nulls)));
}

/* ---------------------------------------------------------------------------
 * complete, release, extend, checkpoint
 * ---------------------------------------------------------------------------
 */

/* Tells whether a header name is in idempotency.header_denylist. */
static bool
header_denied(List *denylist, const char *name, int len)
{
	ListCell   *lc;

	foreach(lc, denylist)
	{
		const char *denied = (const char *) lfirst(lc);

		if ((int) strlen(denied) == len && pg_strncasecmp(denied, name, len) == 0)
			return true;
	}
	return false;
}

/* Raises 22023 for headers of the wrong shape. */
static void
bad_headers(const char *detail)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("invalid response headers"),
			 errdetail_internal("%s", detail)));
}

/* Checks that a header value is a string or an array of strings. */
static void
check_header_value(JsonbValue *v)
{
	JsonbIterator *it;
	JsonbValue	elem;
	JsonbIteratorToken tok;

	if (v->type == jbvString)
		return;
	if (v->type != jbvBinary || !JsonContainerIsArray(v->val.binary.data))
		bad_headers("Each header value must be a string or an array of strings.");
	it = JsonbIteratorInit(v->val.binary.data);
	while ((tok = JsonbIteratorNext(&it, &elem, true)) != WJB_DONE)
		if (tok == WJB_ELEM && elem.type != jbvString)
			bad_headers("Each header value must be a string or an array of strings.");
}

/*
 * Checks the shape of headers (a JSON object of strings or arrays of
 * strings) and returns them without the denied ones.
 */
static Jsonb *
filter_headers(Jsonb *headers)
{
	List	   *denylist = NIL;
	char	   *rawlist = pstrdup(idem_header_denylist ? idem_header_denylist : "");
	JsonbIterator *it;
	JsonbValue	k;
	JsonbValue	v;
	JsonbIteratorToken tok;
	JsonbParseState *state = NULL;
	JsonbValue *res;
	bool		dropped = false;

	if (!JB_ROOT_IS_OBJECT(headers))
		bad_headers("Headers must be a JSON object.");
	/* Like a GUC list: lower-cased unless quoted, and never truncated. */
	if (!SplitGUCList(rawlist, ',', &denylist))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid list syntax in \"idempotency.header_denylist\"")));

	/* First pass: check every value and see whether anything is denied. */
	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &k, true)) != WJB_DONE)
	{
		if (tok != WJB_KEY)
			continue;
		tok = JsonbIteratorNext(&it, &v, true);
		check_header_value(&v);
		if (header_denied(denylist, k.val.string.val, k.val.string.len))
			dropped = true;
	}
	if (!dropped)
		return headers;

	/* Second pass: rebuild the object without the denied headers. */
	it = JsonbIteratorInit(&headers->root);
	res = pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	while ((tok = JsonbIteratorNext(&it, &k, true)) != WJB_DONE)
	{
		if (tok != WJB_KEY)
			continue;
		tok = JsonbIteratorNext(&it, &v, true);
		if (header_denied(denylist, k.val.string.val, k.val.string.len))
			continue;
		pushJsonbValue(&state, WJB_KEY, &k);
		pushJsonbValue(&state, WJB_VALUE, &v);
	}
	res = pushJsonbValue(&state, WJB_END_OBJECT, NULL);
	return JsonbValueToJsonb(res);
}

/*
 * complete(key, fence, status_code, body, headers, scope): stores the
 * response and ends the claim; a 5xx releases it instead (unless
 * idempotency.store_server_errors).  IK001 when the fence lost the claim.
 */
Datum
idempotency_complete(PG_FUNCTION_ARGS)
{
	text	   *key = get_key(fcinfo, 0);
	int64		fence = get_fence(fcinfo, 1);
	int32		status_code;
	Datum		body = PG_ARGISNULL(3) ? (Datum) 0 : PG_GETARG_DATUM(3);
	Jsonb	   *headers = NULL;
	text	   *scope = get_scope(fcinfo, 5);
	bool		release;
	ApiCall		call;
	uint64		done;

	require_arg(fcinfo, 2, "status_code");
	status_code = PG_GETARG_INT32(2);
	if (status_code < 100 || status_code > 599)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status code %d is out of range", status_code),
				 errdetail("An HTTP status code is between 100 and 599.")));
	if (body && toast_raw_datum_size(body) - VARHDRSZ > (Size) idem_max_response_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response body is too large"),
				 errdetail("The body has %zu bytes; idempotency.max_response_bytes allows %d.",
						   toast_raw_datum_size(body) - VARHDRSZ, idem_max_response_bytes)));
	if (!PG_ARGISNULL(4))
		headers = filter_headers(PG_GETARG_JSONB_P(4));
	PreventCommandIfReadOnly("idempotency.complete()");

	release = status_code >= 500 && !idem_store_server_errors;
	api_begin(&call);
	if (release)
	{
		Datum		values[3] = {PointerGetDatum(scope), PointerGetDatum(key), Int64GetDatum(fence)};

		done = run_plan(PLAN_RELEASE, values, NULL, false);
	}
	else
	{
		Datum		values[7] = {PointerGetDatum(scope), PointerGetDatum(key),
			Int64GetDatum(fence), Int32GetDatum(status_code), PointerGetDatum(headers),
		body, TimestampTzGetDatum(GetCurrentTimestamp())};
		char		nulls[7] = {' ', ' ', ' ', ' ', headers ? ' ' : 'n', body ? ' ' : 'n', ' '};

		done = run_plan(PLAN_COMPLETE, values, nulls, false);
	}
	api_end(&call);

	if (done == 0)
		fence_lost(key);
	wait_wake_at_commit(key_hash(scope, key));
	stats_add(release ? IDEM_COMPLETES_RELEASED : IDEM_COMPLETES_STORED, 1);
	PG_RETURN_TEXT_P(cstring_to_text(release ? "released" : "stored"));
}

/* release(key, fence, scope): deletes the claim so that a retry runs again. */
Datum
idempotency_release(PG_FUNCTION_ARGS)
{
	text	   *key = get_key(fcinfo, 0);
	int64		fence = get_fence(fcinfo, 1);
	text	   *scope = get_scope(fcinfo, 2);
	Datum		values[3] = {PointerGetDatum(scope), PointerGetDatum(key), Int64GetDatum(fence)};
	ApiCall		call;
	bool		released;

	PreventCommandIfReadOnly("idempotency.release()");
	api_begin(&call);
	released = run_plan(PLAN_RELEASE, values, NULL, false) == 1;
	api_end(&call);

	if (released)
	{
		wait_wake_at_commit(key_hash(scope, key));
		stats_add(IDEM_RELEASES, 1);
	}
	else
		stats_add(IDEM_FENCE_REJECTIONS, 1);
	PG_RETURN_BOOL(released);
}

/*
 * extend(key, fence, lease, scope): renews the lease; returns its new end.
 * A lease never ends earlier than it did, also after the clock stepped back.
 */
Datum
idempotency_extend(PG_FUNCTION_ARGS)
{
	text	   *key = get_key(fcinfo, 0);
	int64		fence = get_fence(fcinfo, 1);
	Interval   *lease = get_interval(fcinfo, 2, "lease", -1, false);
	text	   *scope = get_scope(fcinfo, 3);
	Datum		values[5] = {PointerGetDatum(scope), PointerGetDatum(key), Int64GetDatum(fence),
		PointerGetDatum(lease), TimestampTzGetDatum(GetCurrentTimestamp())};
	char		nulls[5] = {' ', ' ', ' ', lease ? ' ' : 'n', ' '};
	ApiCall		call;
	TimestampTz ends = 0;
	bool		owned;

	PreventCommandIfReadOnly("idempotency.extend()");
	api_begin(&call);
	owned = run_plan(PLAN_EXTEND, values, nulls, false) == 1;
	if (owned)
		ends = result_timestamp(1);
	api_end(&call);

	if (!owned)
		fence_lost(key);
	PG_RETURN_TIMESTAMPTZ(ends);
}

/*
 * checkpoint(key, fence, recovery_point, recovery_state, scope): saves the
 * progress of multi-step work and renews the lease.
 */
Datum
idempotency_checkpoint(PG_FUNCTION_ARGS)
{
	text	   *key = get_key(fcinfo, 0);
	int64		fence = get_fence(fcinfo, 1);
	text	   *scope = get_scope(fcinfo, 4);
	Datum		values[6];
	char		nulls[6] = {' ', ' ', ' ', ' ', PG_ARGISNULL(3) ? 'n' : ' ', ' '};
	ApiCall		call;
	bool		owned;

	require_arg(fcinfo, 2, "recovery_point");
	values[0] = PointerGetDatum(scope);
	values[1] = PointerGetDatum(key);
	values[2] = Int64GetDatum(fence);
	values[3] = PG_GETARG_DATUM(2);
	values[4] = PG_ARGISNULL(3) ? (Datum) 0 : PG_GETARG_DATUM(3);
	values[5] = TimestampTzGetDatum(GetCurrentTimestamp());

	PreventCommandIfReadOnly("idempotency.checkpoint()");
	api_begin(&call);
	owned = run_plan(PLAN_CHECKPOINT, values, nulls, false) == 1;
	api_end(&call);

	if (!owned)
		fence_lost(key);
	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------------------
 * lookup, reap
 * ---------------------------------------------------------------------------
 */

/*
 * lookup(key, scope): the record as claim would see it, without the fence;
 * no row when it is absent or expired.  Reads only: works on a standby.
 */
Datum
idempotency_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = get_key(fcinfo, 0);
	text	   *scope = get_scope(fcinfo, 1);
	Datum		args[3] = {PointerGetDatum(scope), PointerGetDatum(key),
	TimestampTzGetDatum(GetCurrentTimestamp())};
	TupleDesc	tupdesc;
	Tuplestorestate *store;
	MemoryContext old;
	ApiCall		call;

	if (rsinfo == NULL || !IsA(rsinfo, ReturnSetInfo) ||
		!(rsinfo->allowedModes & SFRM_Materialize))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("set-valued function called in context that cannot accept a set")));
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");

	old = MemoryContextSwitchTo(rsinfo->econtext->ecxt_per_query_memory);
	tupdesc = CreateTupleDescCopy(tupdesc);
	store = tuplestore_begin_heap(true, false, work_mem);
	MemoryContextSwitchTo(old);

	api_begin(&call);
	if (run_plan(PLAN_LOOKUP, args, NULL, true) == 1)
		tuplestore_puttuple(store, SPI_tuptable->vals[0]);
	api_end(&call);

	rsinfo->returnMode = SFRM_Materialize;
	rsinfo->setResult = store;
	rsinfo->setDesc = tupdesc;
	return (Datum) 0;
}

/* Deletes up to batch expired records, oldest first, skipping locked ones. */
uint64
reap_expired(int batch)
{
	TimestampTz now = GetCurrentTimestamp();
	Datum		args[2] = {TimestampTzGetDatum(now), Int32GetDatum(batch)};
	ApiCall		call;
	uint64		reaped;

	api_begin(&call);
	reaped = run_plan(PLAN_REAP, args, NULL, false);
	api_end(&call);

	stats_add(IDEM_REAPED, reaped);
	stats_set_last_reap(now);
	return reaped;
}

/* reap(batch): deletes up to batch expired records and returns how many. */
Datum
idempotency_reap(PG_FUNCTION_ARGS)
{
	int32		batch = PG_ARGISNULL(0) ? idem_reaper_batch : PG_GETARG_INT32(0);

	if (batch <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch must be positive")));
	PreventCommandIfReadOnly("idempotency.reap()");
	PG_RETURN_INT64((int64) reap_expired(batch));
}
