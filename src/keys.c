/*-------------------------------------------------------------------------
 * keys.c
 *	  The statements on idempotency.keys: a call of the API, as the table's
 *	  owner, and the SPI plans of the writes and reads that are not on the
 *	  hot path (keysread.c and keyswrite.c have those, and fall back to the
 *	  plans here).
 *
 * Application roles get no privilege on the table: each call acts as the
 * table's owner (owner.c: the right to call, the switch), and runs SPI
 * plans prepared once per backend and relation: a call works on the table
 * itself, or with Citus on the scope's local shard, which citus.c chooses.
 * Every name in the plans is schema-qualified, operators included, so that
 * the caller's search_path cannot change their meaning, and every plan
 * names the table with ONLY: a DBA's inheritance children of it hold no
 * records, and a ctid (reap's) is unique only within one table.  The hot
 * path, claim's read and insert and complete's update, does without the
 * executor (keysread.c, keyswrite.c): the read took replays from 0.68x to 0.95x a bare
 * primary-key SELECT (bench/run).
 *
 * A record belongs to the role that claimed it, and is seen only by roles
 * that have the privileges of that owner: for any other role it is as if
 * it were in another scope.  The extension makes the primary key (key,
 * scope, owner); a DBA may rebuild it in another column order or as a unique
 * constraint: ON CONFLICT (key, scope, owner) finds it in any order, and
 * without one claim and complete refuse before any plan runs (keysrel.c).
 *
 * The unique index decides every race: claim's speculative insertion
 * (keyswrite.c) fails on a concurrent writer's record, and UPDATEs whose
 * WHERE clause repeats their condition wait for a concurrent writer of the
 * same record as PostgreSQL makes them.  A claim that must bound
 * that wait (its `wait`) finds the writing transaction first, with a dirty
 * read, and waits for it (wait.c), where a timeout can be caught.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "fence.h"
#include "gauges.h"
#include "keys.h"

/*
 * The plans.  Operators are written OPERATOR(pg_catalog.x): the plans run as
 * the table's owner, and an operator found through the caller's search_path
 * would run with the owner's rights.
 */
#define EQ " OPERATOR(pg_catalog.=) "
#define NE " OPERATOR(pg_catalog.<>) "
#define LE " OPERATOR(pg_catalog.<=) "
#define PLUS " OPERATOR(pg_catalog.+) "
#define MINUS " OPERATOR(pg_catalog.-) "
#define KEY_IS "scope" EQ "$1 AND key" EQ "$2"
#define IN_PROGRESS "'in_progress'::idempotency.state"
#define COMPLETED "'completed'::idempotency.state"
/* The record is seen by the caller, role $n: its own, or one whose privileges it has. */
#define SEEN_BY(n) "(owner" EQ n " OR pg_catalog.pg_has_role(" n ", owner, 'USAGE'))"
/* The caller ($4) sees the record and this fence ($3) owns it. */
#define OWNED_BY_FENCE KEY_IS " AND fence" EQ "$3 AND state" EQ IN_PROGRESS " AND " SEEN_BY("$4")
/* The records that claim treats as absent and reap may delete, at time $n. */
#define EXPIRED_AT(n) "expires_at" LE n " AND (state" EQ COMPLETED " OR lease_expires_at" LE n ")"
/* The key of the reaper's index (keys_expiry_second_idx). */
#define EXPIRY_SECOND(t) "idempotency._expiry_second(" t ")"
/*
 * reap's deletion of up to $2 records expired at $1 that also meet cond,
 * oldest first, skipping locked ones.  cond is checked before a row is
 * locked: a row it leaves out is never locked.
 */
#define REAP_WHERE(cond) "DELETE FROM ONLY idempotency.keys WHERE ctid" EQ "ANY (ARRAY("\
	"SELECT ctid FROM ONLY idempotency.keys WHERE " EXPIRY_SECOND("expires_at") LE EXPIRY_SECOND("$1")\
	" AND " EXPIRED_AT("$1") cond " ORDER BY " EXPIRY_SECOND("expires_at") ", expires_at"\
	" LIMIT $2 FOR UPDATE SKIP LOCKED))"\
	" RETURNING fence, state" EQ IN_PROGRESS
/*
 * The lease's end becomes e, never earlier, and the record's expiry moves
 * later by as much as the lease's end did: a response stored at the end of
 * a renewed or taken-over lease is kept as long as one stored at the end of
 * the first (retention minus lease), never stored already expired.
 */
#define LEASE_ENDS(e) "lease_expires_at = GREATEST(lease_expires_at, " e "),"\
	" expires_at = expires_at" PLUS "GREATEST((" e ")" MINUS "lease_expires_at, '0'::pg_catalog.interval)"
/*
 * SQL about claim's token column, left out of the plan on a table of version
 * 1.1, which has no such column (the library may be newer than the
 * extension's objects until ALTER EXTENSION UPDATE).
 */
#define TOKEN_ONLY(sql) TOKEN_BEGIN sql TOKEN_END
#define TOKEN_BEGIN "/*token*/"
#define TOKEN_END "/*/token*/"
/* Sets the claim's token to parameter n. */
#define SET_TOKEN(n) TOKEN_ONLY(" token = " n ",")

/* claim's insert of a new record (PLAN_INSERT*), and the types of its parameters. */
#define INSERT_CLAIM "INSERT INTO idempotency.keys (fence, created_at, expires_at, lease_expires_at,"\
	" lease, attempt, state, owner, scope, key, fingerprint" TOKEN_ONLY(", token") ")"\
	" VALUES ($9, $6, $7, $8, $5, 1, " IN_PROGRESS ", $3, $1, $2, $4" TOKEN_ONLY(", $10") ")"
#define INSERT_CLAIM_ARGTYPES TEXTOID, TEXTOID, REGROLEOID, BYTEAOID, INTERVALOID, \
	TIMESTAMPTZOID, TIMESTAMPTZOID, TIMESTAMPTZOID, INT8OID, UUIDOID

typedef enum PlanId
{
	PLAN_RESET,
	PLAN_TAKEOVER,
	PLAN_RESTAMP,
	PLAN_RELEASE,
	PLAN_EXTEND,
	PLAN_CHECKPOINT,
	PLAN_LOOKUP,
	PLAN_REAP,
	PLAN_REAP_SEEN,
	PLAN_INSERT,
	PLAN_INSERT_ANY_ARBITER,
	PLAN_COMPLETE,
	NUM_PLANS
} PlanId;

typedef struct PlanDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[10];
} PlanDef;

static const PlanDef plan_defs[NUM_PLANS] = {
	[PLAN_RESET] = {
		"UPDATE ONLY idempotency.keys SET fingerprint = $4, state = " IN_PROGRESS ","
		" fence = $9," SET_TOKEN("$10") " attempt = 1, lease = $5, lease_expires_at = $7" PLUS "$5,"
		" recovery_point = NULL, recovery_state = NULL, status_code = NULL,"
		" headers = NULL, body = NULL, created_at = $7, completed_at = NULL,"
		" expires_at = $7" PLUS "$6"
		" WHERE " KEY_IS " AND owner" EQ "$3 AND fence" EQ "$8 AND " EXPIRED_AT("$7")
		" RETURNING lease_expires_at",
		10, {TEXTOID, TEXTOID, REGROLEOID, BYTEAOID, INTERVALOID, INTERVALOID, TIMESTAMPTZOID,
		INT8OID, INT8OID, UUIDOID}
	},
	[PLAN_TAKEOVER] = {
		"UPDATE ONLY idempotency.keys SET fence = $7," SET_TOKEN("$8") " attempt = attempt" PLUS "1,"
		" lease = $5, " LEASE_ENDS("$6" PLUS "$5")
		" WHERE " KEY_IS " AND owner" EQ "$3 AND fence" EQ "$4 AND state" EQ IN_PROGRESS
		" AND lease_expires_at" LE "$6 AND NOT (" EXPIRED_AT("$6") ")"
		" RETURNING attempt, recovery_point, recovery_state, created_at, lease_expires_at",
		8, {TEXTOID, TEXTOID, REGROLEOID, INT8OID, INTERVALOID, TIMESTAMPTZOID, INT8OID, UUIDOID}
	},
	[PLAN_RESTAMP] = {
		"UPDATE ONLY idempotency.keys SET lease_expires_at = $5" PLUS "lease,"
		" created_at = CASE WHEN $6 IS NULL THEN created_at ELSE $5 END,"
		" expires_at = COALESCE($5" PLUS "$6, expires_at" PLUS
		"GREATEST(($5" PLUS "lease)" MINUS "lease_expires_at, '0'::pg_catalog.interval))"
		" WHERE " KEY_IS " AND owner" EQ "$3 AND fence" EQ "$4 RETURNING lease_expires_at",
		6, {TEXTOID, TEXTOID, REGROLEOID, INT8OID, TIMESTAMPTZOID, INTERVALOID}
	},
	[PLAN_RELEASE] = {
		"DELETE FROM ONLY idempotency.keys WHERE " OWNED_BY_FENCE,
		4, {TEXTOID, TEXTOID, INT8OID, REGROLEOID}
	},
	[PLAN_EXTEND] = {
		"UPDATE ONLY idempotency.keys SET " LEASE_ENDS("$6" PLUS "COALESCE($5, lease)")
		" WHERE " OWNED_BY_FENCE " AND NOT (" EXPIRED_AT("$6") ") RETURNING lease_expires_at",
		6, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, INTERVALOID, TIMESTAMPTZOID}
	},
	[PLAN_CHECKPOINT] = {
		"UPDATE ONLY idempotency.keys SET recovery_point = $5, recovery_state = $6, "
		LEASE_ENDS("$7" PLUS "lease")
		" WHERE " OWNED_BY_FENCE " AND NOT (" EXPIRED_AT("$7") ") RETURNING lease_expires_at",
		7, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, TEXTOID, JSONBOID, TIMESTAMPTZOID}
	},
	[PLAN_LOOKUP] = {
		"SELECT scope::pg_catalog.text, key, fingerprint, state::pg_catalog.text, attempt, lease,"
		" lease_expires_at, recovery_point, recovery_state, status_code, headers,"
		" body, created_at, completed_at, expires_at FROM ONLY idempotency.keys"
		" WHERE " KEY_IS " AND " SEEN_BY("$3") " AND NOT (" EXPIRED_AT("$4") ")"
		" ORDER BY owner" NE "$3, owner::pg_catalog.oid LIMIT 1",
		4, {TEXTOID, TEXTOID, REGROLEOID, TIMESTAMPTZOID}
	},
	[PLAN_REAP] = {
		REAP_WHERE(""),
		2, {TIMESTAMPTZOID, INT4OID}
	},
	[PLAN_REAP_SEEN] = {
		REAP_WHERE(" AND " SEEN_BY("$3")),
		3, {TIMESTAMPTZOID, INT4OID, REGROLEOID}
	},
	/* The executor's forms of keyswrite.c's direct insert and update. */
	[PLAN_INSERT] = {
		INSERT_CLAIM " ON CONFLICT (key, scope, owner) DO NOTHING",
		10, {INSERT_CLAIM_ARGTYPES}
	},
	/*
	 * Where every unique index is a key index (keysrel.c): the primary key
	 * or a copy of it (REINDEX CONCURRENTLY's, not yet valid, which ON CONFLICT (key, scope, owner)
	 * would not take as an arbiter but would check, raising 23505): all of
	 * them are arbiters.
	 */
	[PLAN_INSERT_ANY_ARBITER] = {
		INSERT_CLAIM " ON CONFLICT DO NOTHING",
		10, {INSERT_CLAIM_ARGTYPES}
	},
	[PLAN_COMPLETE] = {
		"UPDATE ONLY idempotency.keys SET" SET_TOKEN("NULL") " state = " COMPLETED ", status_code = $5, headers = $6,"
		" body = $7, completed_at = $8, lease_expires_at = NULL, lease = NULL"
		" WHERE " OWNED_BY_FENCE " AND NOT (" EXPIRED_AT("$8") ")",
		8, {TEXTOID, TEXTOID, INT8OID, REGROLEOID, INT4OID, JSONBOID, BYTEAOID, TIMESTAMPTZOID}
	},
};

/*
 * The plans of one relation (idempotency.keys, or one of its Citus shards),
 * prepared on first use: each plan's SQL names that relation.  Keyed by the
 * relation's name, not its OID, so that the plan cache re-resolves the name
 * when the relation is dropped and made again (a shard moved away and back).
 */
typedef struct PlanSet
{
	char		name[IDEM_REL_NAME_SIZE];	/* hash key */
	bool		has_token;		/* whether the plans set the token */
	Oid			scope_type;		/* the type of their scope parameter, $1 */
	SPIPlanPtr	plans[NUM_PLANS];
} PlanSet;

static HTAB *plan_sets = NULL;
static PlanSet *last_plan_set = NULL;

/* Whether this call has connected to SPI: only calls that run a plan do. */
static bool spi_connected = false;

PG_FUNCTION_INFO_V1(idempotency_expiry_second);

/*
 * Checks that the caller may use the API and acts as the table's owner, as
 * owner.c does it (SPI is connected when a plan first runs); the call works
 * on idempotency.keys unless citus.c chooses a shard.  An error before
 * idem_call_end needs no cleanup: (sub)transaction abort restores the user
 * and the settings, and closes SPI.
 */
void
idem_call_begin(IdemCall *call)
{
	idem_call_begin_read(call);
	idem_call_restrict(call);
}

/*
 * Begins a call as idem_call_begin does, but leaves the search_path to
 * idem_call_restrict, which the call must reach before anything but a
 * plain read of the key index (owner.c): claim's answers without a write.
 */
void
idem_call_begin_read(IdemCall *call)
{
	const IdemKeysCatalog *c = idem_keys_catalog();

	call->caller = GetUserId();
	idem_owner_check_caller(c->namespace, call->caller);
	call->rel = c->keys;
	call->caller_cxt = CurrentMemoryContext;
	idem_owner_become(c->table_owner, &call->owner_save);
	spi_connected = false;
}

/* Restricts the call's search_path, once: before anything may run code of someone's. */
void
idem_call_restrict(IdemCall *call)
{
	idem_owner_restrict_path(&call->owner_save);
}

/* Leaves SPI, if the call used it, and returns to the caller's user and settings. */
void
idem_call_end(IdemCall *call)
{
	if (spi_connected)
		SPI_finish();
	spi_connected = false;
	idem_owner_leave(&call->owner_save);
}

/*
 * Returns the SQL of a plan for relation rel: the plan's own with rel's name
 * for idempotency.keys, and without its TOKEN_ONLY parts when rel has no
 * token column.
 */
static char *
plan_sql(const char *sql, const IdemKeysRel *rel)
{
	static const char table[] = "idempotency.keys";
	bool		has_token = IDEM_HAS_TOKEN(rel);
	StringInfoData buf;

	initStringInfo(&buf);
	while (*sql)
	{
		if (strncmp(sql, table, strlen(table)) == 0)
		{
			appendStringInfoString(&buf, rel->name);
			sql += strlen(table);
		}
		else if (!has_token && strncmp(sql, TOKEN_BEGIN, strlen(TOKEN_BEGIN)) == 0)
			sql = strstr(sql, TOKEN_END) + strlen(TOKEN_END);
		else
			appendStringInfoChar(&buf, *sql++);
	}
	return buf.data;
}

/* Returns plan id for relation rel, preparing and saving it on first use. */
static SPIPlanPtr
plan_for(PlanId id, const IdemKeysRel *rel)
{
	PlanSet    *set = last_plan_set;

	if (set == NULL || strcmp(set->name, rel->name) != 0)
	{
		bool		found;

		if (plan_sets == NULL)
		{
			HASHCTL		ctl = {.keysize = IDEM_REL_NAME_SIZE, .entrysize = sizeof(PlanSet)};

			plan_sets = hash_create("idempotency plans", 8, &ctl, HASH_ELEM | HASH_STRINGS);
		}
		set = hash_search(plan_sets, rel->name, HASH_ENTER, &found);
		if (!found)
		{
			memset(set->plans, 0, sizeof(set->plans));
			set->has_token = IDEM_HAS_TOKEN(rel);
			set->scope_type = rel->scope.type;
		}
		last_plan_set = set;
	}
	/*
	 * ALTER EXTENSION UPDATE made the table again, with the token column, or
	 * citus_distribute gave the scope a tenant's type.
	 */
	if (set->has_token != IDEM_HAS_TOKEN(rel) || set->scope_type != rel->scope.type)
	{
		for (int i = 0; i < NUM_PLANS; i++)
			if (set->plans[i])
				SPI_freeplan(set->plans[i]);
		memset(set->plans, 0, sizeof(set->plans));
		set->has_token = IDEM_HAS_TOKEN(rel);
		set->scope_type = rel->scope.type;
	}
	if (set->plans[id] == NULL)
	{
		const PlanDef *def = &plan_defs[id];
		char	   *sql = plan_sql(def->sql, rel);
		Oid			argtypes[lengthof(def->argtypes)];
		SPIPlanPtr	plan;

		/* Every plan but the reaper's takes the scope as $1, in the column's type. */
		memcpy(argtypes, def->argtypes, sizeof(argtypes));
		if (id != PLAN_REAP && id != PLAN_REAP_SEEN)
			argtypes[0] = rel->scope.type;
		plan = SPI_prepare(sql, def->nargs, argtypes);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed for \"%s\": %s",
				 sql, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "SPI_keepplan failed");
		pfree(sql);
		set->plans[id] = plan;
	}
	return set->plans[id];
}

/*
 * Runs a plan on the call's relation, with the search_path restricted (the
 * executor may run a DBA's code); returns rows processed.
 */
static uint64
run_plan(PlanId id, IdemCall *call, Datum *values, const char *nulls, bool read_only)
{
	int			rc;

	idem_call_restrict(call);
	if (!spi_connected)
	{
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		spi_connected = true;
	}
	rc = SPI_execute_plan(plan_for(id, &call->rel), values, nulls, read_only, 0);
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

/* Returns a copy of a varlena value, detoasted, made in cxt; NULL when isnull. */
struct varlena *
idem_varlena_copy(Datum value, bool isnull, MemoryContext cxt)
{
	MemoryContext old;
	struct varlena *copy;

	if (isnull)
		return NULL;
	old = MemoryContextSwitchTo(cxt);
	copy = PG_DETOAST_DATUM_COPY(value);
	MemoryContextSwitchTo(old);
	return copy;
}

/* Returns a varlena column of the first result row, detoasted into cxt; NULL when NULL. */
static struct varlena *
result_varlena(int n, MemoryContext cxt)
{
	bool		isnull;
	Datum		value = result_col(n, &isnull);

	return idem_varlena_copy(value, isnull, cxt);
}

/* The whole second, rounded down, of a timestamp: the reaper's index key. */
Datum
idempotency_expiry_second(PG_FUNCTION_ARGS)
{
	TimestampTz t = PG_GETARG_TIMESTAMPTZ(0);

	/* Floor division, also before 2000 (negative timestamps). */
	PG_RETURN_INT64(t >= 0 ? t / USECS_PER_SEC : -((-(t + 1)) / USECS_PER_SEC) - 1);
}

/*
 * Makes the caller's expired record of (scope, key), whose fence is
 * old_fence, a new claim with token (NULL: none); returns whether it was
 * still that record and expired, and the new fence.
 */
bool
idem_keys_reset(IdemCall *call, text *key, bytea *fingerprint, int64 old_fence,
				Interval *lease, Interval *retention, const pg_uuid_t *token,
				TimestampTz now, int64 *fence)
{
	int64		new_fence = idem_keys_next_fence(old_fence + 1);
	Datum		values[10] = {call->scope, PointerGetDatum(key),
		ObjectIdGetDatum(call->caller), PointerGetDatum(fingerprint), IntervalPGetDatum(lease),
		IntervalPGetDatum(retention), TimestampTzGetDatum(now), Int64GetDatum(old_fence),
	Int64GetDatum(new_fence), UUIDPGetDatum(token)};
	char		nulls[10] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', token ? ' ' : 'n'};

	bool		isnull;

	if (run_plan(PLAN_RESET, call, values, nulls, false) != 1)
		return false;
	*fence = new_fence;
	idem_gauges_ended(call->rel.relid, old_fence);
	idem_gauges_claimed(call->rel.relid, new_fence,
						DatumGetTimestampTz(result_col(1, &isnull)));
	return true;
}

/*
 * Takes over the claim that fence held, if its lease has still ended and
 * it is still that fence's: a new fence and the taker's token (NULL: none),
 * one more attempt, the recovery point kept.  Returns whether it did.
 */
bool
idem_keys_takeover(IdemCall *call, text *key, Oid owner, int64 fence,
				   Interval *lease, const pg_uuid_t *token, TimestampTz now,
				   IdemTakeover *result)
{
	int64		new_fence = idem_keys_next_fence(fence + 1);
	Datum		values[8] = {call->scope, PointerGetDatum(key),
		ObjectIdGetDatum(owner), Int64GetDatum(fence), IntervalPGetDatum(lease),
	TimestampTzGetDatum(now), Int64GetDatum(new_fence), UUIDPGetDatum(token)};
	char		nulls[8] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', token ? ' ' : 'n'};
	bool		isnull;

	if (run_plan(PLAN_TAKEOVER, call, values, nulls, false) != 1)
		return false;
	result->fence = new_fence;
	result->attempt = DatumGetInt32(result_col(1, &isnull));
	result->recovery_point = (text *) result_varlena(2, call->caller_cxt);
	result->recovery_state = (Jsonb *) result_varlena(3, call->caller_cxt);
	result->created_at = DatumGetTimestampTz(result_col(4, &isnull));
	idem_gauges_ended(call->rel.relid, fence);
	idem_gauges_claimed(call->rel.relid, new_fence,
						DatumGetTimestampTz(result_col(5, &isnull)));
	return true;
}

/*
 * Restarts, at now, the lease of the claim that fence just won, and with a
 * retention also its record's life: for a claim whose write was kept
 * waiting by another transaction, so that its lease starts when it won.
 */
void
idem_keys_restamp(IdemCall *call, text *key, Oid owner, int64 fence,
				  TimestampTz now, Interval *retention)
{
	Datum		values[6] = {call->scope, PointerGetDatum(key),
		ObjectIdGetDatum(owner), Int64GetDatum(fence), TimestampTzGetDatum(now),
	PointerGetDatum(retention)};
	char		nulls[6] = {' ', ' ', ' ', ' ', ' ', retention ? ' ' : 'n'};
	bool		isnull;

	if (run_plan(PLAN_RESTAMP, call, values, nulls, false) != 1)
		elog(ERROR, "the claim just won of idempotency key \"%s\" is gone",
			 text_to_cstring(key));
	idem_gauges_leased(call->rel.relid, fence, DatumGetTimestampTz(result_col(1, &isnull)));
}

/* Deletes the claim if this fence owns it and the caller sees it. */
bool
idem_keys_release(IdemCall *call, text *key, int64 fence)
{
	Datum		values[4] = {call->scope, PointerGetDatum(key),
	Int64GetDatum(fence), ObjectIdGetDatum(call->caller)};

	if (run_plan(PLAN_RELEASE, call, values, NULL, false) != 1)
		return false;
	idem_gauges_ended(call->rel.relid, fence);
	return true;
}

/*
 * Renews the lease by lease (NULL: the claim's own length) from now, never
 * shortening it; sets *ends to its end.  False when the fence lost the claim.
 */
bool
idem_keys_extend(IdemCall *call, text *key, int64 fence, Interval *lease,
				 TimestampTz now, TimestampTz *ends)
{
	Datum		values[6] = {call->scope, PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), PointerGetDatum(lease),
	TimestampTzGetDatum(now)};
	char		nulls[6] = {' ', ' ', ' ', ' ', lease ? ' ' : 'n', ' '};
	bool		isnull;

	if (run_plan(PLAN_EXTEND, call, values, nulls, false) != 1)
		return false;
	*ends = DatumGetTimestampTz(result_col(1, &isnull));
	idem_gauges_leased(call->rel.relid, fence, *ends);
	return true;
}

/* Saves a recovery point and renews the lease; false when the fence lost the claim. */
bool
idem_keys_checkpoint(IdemCall *call, text *key, int64 fence,
					 text *recovery_point, Jsonb *recovery_state, TimestampTz now)
{
	Datum		values[7] = {call->scope, PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), PointerGetDatum(recovery_point),
	PointerGetDatum(recovery_state), TimestampTzGetDatum(now)};
	char		nulls[7] = {' ', ' ', ' ', ' ', ' ', recovery_state ? ' ' : 'n', ' '};
	bool		isnull;

	if (run_plan(PLAN_CHECKPOINT, call, values, nulls, false) != 1)
		return false;
	idem_gauges_leased(call->rel.relid, fence, DatumGetTimestampTz(result_col(1, &isnull)));
	return true;
}

/*
 * Returns the record of (scope, key) the caller sees, as lookup() shows it,
 * copied into the caller's memory; NULL when there is none or it expired.
 */
HeapTuple
idem_keys_lookup(IdemCall *call, text *key, TimestampTz now)
{
	Datum		values[4] = {call->scope, PointerGetDatum(key),
	ObjectIdGetDatum(call->caller), TimestampTzGetDatum(now)};
	MemoryContext old;
	HeapTuple	tuple;

	if (run_plan(PLAN_LOOKUP, call, values, NULL, true) != 1)
		return NULL;
	old = MemoryContextSwitchTo(call->caller_cxt);
	tuple = heap_copytuple(SPI_tuptable->vals[0]);
	MemoryContextSwitchTo(old);
	return tuple;
}

/*
 * Deletes up to batch records of the call's relation expired at now, oldest
 * first, skipping locked ones; returns how many.  Used by reap() and by the
 * background reaper.  A caller deletes, and so locks until it ends, only
 * the records it sees: an open transaction that reaped never holds another
 * role's records and keeps their claims waiting.  A caller with the
 * privileges of the table's owner (a superuser, the background reaper),
 * who could delete every record anyway, reaps them all.
 */
uint64
idem_keys_reap(IdemCall *call, int batch, TimestampTz now)
{
	Datum		values[3] = {TimestampTzGetDatum(now), Int32GetDatum(batch),
	ObjectIdGetDatum(call->caller)};
	bool		every = has_privs_of_role(call->caller, idem_keys_catalog()->table_owner);
	uint64		reaped = run_plan(every ? PLAN_REAP : PLAN_REAP_SEEN, call, values, NULL, false);

	for (uint64 i = 0; i < reaped; i++)
	{
		bool		isnull;
		HeapTuple	row = SPI_tuptable->vals[i];

		if (DatumGetBool(SPI_getbinval(row, SPI_tuptable->tupdesc, 2, &isnull)))
			idem_gauges_ended(call->rel.relid,
							  DatumGetInt64(SPI_getbinval(row, SPI_tuptable->tupdesc, 1, &isnull)));
	}
	return reaped;
}

/*
 * idem_keys_insert through the executor, for a table on which the direct
 * insert would not do what INSERT does (keysindex.c): the valid unique
 * indexes on (key, scope, owner) are the arbiters, and with any_arbiter so
 * is every other unique index (the caller knows they are all key indexes), any other unique violation is an
 * error.  Returns false when a record of (scope, key, caller) exists
 * already; sets *fence.  The token (NULL: none) is stored as the direct
 * insert stores it.
 */
bool
idem_keys_insert_sql(IdemCall *call, text *key, bytea *fingerprint,
					 Interval *lease, TimestampTz now, TimestampTz expires_at,
					 TimestampTz lease_expires_at, const pg_uuid_t *token, bool any_arbiter,
					 int64 *fence)
{
	int64		new_fence = idem_keys_next_fence(0);
	Datum		values[10] = {call->scope, PointerGetDatum(key),
		ObjectIdGetDatum(call->caller), PointerGetDatum(fingerprint), IntervalPGetDatum(lease),
		TimestampTzGetDatum(now), TimestampTzGetDatum(expires_at),
		TimestampTzGetDatum(lease_expires_at), Int64GetDatum(new_fence),
	UUIDPGetDatum(token)};
	char		nulls[10] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', token ? ' ' : 'n'};

	if (run_plan(any_arbiter ? PLAN_INSERT_ANY_ARBITER : PLAN_INSERT, call, values, nulls,
				 false) != 1)
		return false;
	*fence = new_fence;
	idem_gauges_claimed(call->rel.relid, new_fence, lease_expires_at);
	return true;
}

/* idem_keys_complete through the executor (see idem_keys_insert_sql). */
bool
idem_keys_complete_sql(IdemCall *call, text *key, int64 fence, int32 status_code,
					   Jsonb *headers, bytea *body, TimestampTz now)
{
	Datum		values[8] = {call->scope, PointerGetDatum(key),
		Int64GetDatum(fence), ObjectIdGetDatum(call->caller), Int32GetDatum(status_code),
	PointerGetDatum(headers), PointerGetDatum(body), TimestampTzGetDatum(now)};
	char		nulls[8] = {' ', ' ', ' ', ' ', ' ', headers ? ' ' : 'n', body ? ' ' : 'n', ' '};

	if (run_plan(PLAN_COMPLETE, call, values, nulls, false) != 1)
		return false;
	idem_gauges_ended(call->rel.relid, fence);
	return true;
}
