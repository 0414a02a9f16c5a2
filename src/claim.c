/*-------------------------------------------------------------------------
 * claim.c
 *	  claim(): decides whether to run a request, and waits when asked to.
 *
 * A claim reads the record (keysread.c, a direct key-index lookup) and
 * decides, in the design's order: an expired record counts as absent; a
 * different fingerprint is a mismatch; a completed record is a replay; a
 * live lease is in progress; an ended lease is a takeover.  Only `new`
 * writes, with one conditional write: the unique index and the write's own
 * WHERE clause settle any race (waiting, as PostgreSQL does, for another
 * transaction that writes the same record), and a write that a concurrent
 * transaction made moot sends the claim round again.  A write kept waiting
 * restarts its lease when it wins.  Replays, mismatches and in_progress
 * answers write nothing.
 *
 * A claim with a token (1.2) that finds the live claim of its own role,
 * fingerprint and token answers `new` again, with that claim's fence and
 * attempt, and writes nothing: it is the same attempt asking again after
 * losing the answer.  It first waits for a transaction that is writing the
 * record (its own lost complete, say), as a write would, and answers from
 * what committed: it reads the record again after finding no writer, so
 * that a write that committed between its read and that check is seen.  Any other record goes as without a token; the token is
 * written with each `new` (insert, reset, takeover) and cleared by complete.
 *
 * Under REPEATABLE READ or SERIALIZABLE a claim reads under its
 * transaction's snapshot.  A record that a transaction committed after the
 * snapshot has changed (completed, released, extended, taken over) makes
 * it fail with 40001, as an UPDATE of the record would, rather than answer
 * from the past: with the token, `new` for a request that already ran.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/transam.h"
#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "portability/instr_time.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "citus.h"
#include "fence.h"
#include "idempotency.h"
#include "keys.h"
#include "keysread.h"
#include "keyswrite.h"
#include "stats.h"
#include "wait.h"

/* A claim that keeps losing races to concurrent writers gives up with 40001. */
#define CLAIM_MAX_TRIES 16

/* Longest single sleep of a waiting claim: a safety net for missed wake-ups. */
#define WAIT_MAX_SLEEP_MS 1000

/*
 * An update (reset, takeover) that took longer than this waited for another
 * transaction's write of the row: the claim's lease then restarts when it
 * won.  Leases are far longer.
 */
#define WRITE_DELAY_RESTAMP_US 1000

typedef enum ClaimOutcome
{
	CLAIM_NEW,
	CLAIM_REPLAY,
	CLAIM_IN_PROGRESS,
	CLAIM_MISMATCH
} ClaimOutcome;

static const char *const outcome_names[] = {"new", "replay", "in_progress", "mismatch"};

/* The columns of claim's result row. */
enum
{
	OUT_OUTCOME, OUT_FENCE, OUT_ATTEMPT, OUT_STATUS_CODE, OUT_HEADERS, OUT_BODY,
	OUT_RECOVERY_POINT, OUT_RECOVERY_STATE, OUT_RETRY_AFTER, OUT_CREATED_AT,
	NUM_OUT
};

/* What a record tells a claim to do. */
typedef enum ClaimStep
{
	STEP_ANSWER,				/* replay, in_progress or mismatch: no write */
	STEP_RESUME,				/* `new` again for the token's claim: no write */
	STEP_INSERT,				/* no record the caller sees, or another's expired one */
	STEP_RESET,					/* the caller's own expired record */
	STEP_TAKEOVER				/* a lease that ended */
} ClaimStep;

typedef struct ClaimArgs
{
	text	   *scope;
	text	   *key;
	bytea	   *fingerprint;
	Interval   *lease;
	Interval   *retention;
	pg_uuid_t  *token;			/* NULL when none */
	uint64		keyhash;		/* 0 when the claim does not wait */
} ClaimArgs;

typedef struct ClaimResult
{
	ClaimOutcome outcome;
	bool		takeover;
	bool		resumed;
	/* for in_progress: when the lease ends; DT_NOBEGIN while not yet committed */
	TimestampTz lease_expires_at;
	Datum		values[NUM_OUT];
	bool		nulls[NUM_OUT];
} ClaimResult;

PG_FUNCTION_INFO_V1(idempotency_claim);

/* Sets column col of the result. */
static void
set_out(ClaimResult *r, int col, Datum value)
{
	r->values[col] = value;
	r->nulls[col] = false;
}

/* Sets a varlena column of the result, leaving it NULL for a NULL pointer. */
static void
set_out_varlena(ClaimResult *r, int col, void *value)
{
	if (value != NULL)
		set_out(r, col, PointerGetDatum(value));
}

/* Tells whether rec is the live claim that the caller's token made. */
static bool
is_token_claim(const IdemRecord *rec, const pg_uuid_t *token, Oid caller)
{
	return token != NULL && rec->has_token && rec->owner == caller &&
		memcmp(rec->token.data, token->data, UUID_LEN) == 0;
}

/*
 * Decides what the record (found or not) tells the claim at time now; for
 * an answer, fills it in.
 */
static ClaimStep
decide(const IdemRecord *rec, bool found, const pg_uuid_t *token, Oid caller,
	   TimestampTz now, ClaimResult *r)
{
	if (!found)
		return STEP_INSERT;
	if (rec->expires_at <= now && (rec->completed || rec->lease_expires_at <= now))
		return rec->owner == caller ? STEP_RESET : STEP_INSERT;

	set_out(r, OUT_CREATED_AT, TimestampTzGetDatum(rec->created_at));
	if (!rec->same_fingerprint)
		r->outcome = CLAIM_MISMATCH;
	else if (rec->completed)
	{
		r->outcome = CLAIM_REPLAY;
		set_out(r, OUT_STATUS_CODE, Int32GetDatum(rec->status_code));
		set_out_varlena(r, OUT_HEADERS, rec->headers);
		set_out_varlena(r, OUT_BODY, rec->body);
	}
	else if (rec->lease_expires_at > now && is_token_claim(rec, token, caller))
	{
		r->outcome = CLAIM_NEW;
		r->resumed = true;
		set_out(r, OUT_FENCE, Int64GetDatum(rec->fence));
		set_out(r, OUT_ATTEMPT, Int32GetDatum(rec->attempt));
		set_out_varlena(r, OUT_RECOVERY_POINT, rec->recovery_point);
		set_out_varlena(r, OUT_RECOVERY_STATE, rec->recovery_state);
		return STEP_RESUME;
	}
	else if (rec->lease_expires_at > now)
	{
		r->outcome = CLAIM_IN_PROGRESS;
		r->lease_expires_at = rec->lease_expires_at;
	}
	else
		return STEP_TAKEOVER;
	return STEP_ANSWER;
}

/*
 * Makes the write of step at now; fills in a `new` answer and returns true
 * when it won.  An update kept waiting by another transaction's write of the
 * row restarts the lease, and for a reset record its life, when it won.  An
 * insert never waits (a conflict makes it fail, and the claim waits and
 * reads again): it needs no such restamp, which on a busy machine a mere
 * preemption would trigger.
 */
static bool
write_claim(ClaimStep step, const ClaimArgs *a, IdemCall *call, const IdemRecord *rec,
			TimestampTz now, ClaimResult *r)
{
	int64		fence;
	IdemTakeover t;
	Oid			owner = (step == STEP_TAKEOVER) ? rec->owner : call->caller;
	TimestampTz won;

	switch (step)
	{
		case STEP_INSERT:
		case STEP_RESET:
			if (!(step == STEP_INSERT ?
				  idem_keys_insert(call, a->key, a->fingerprint,
								   a->lease, a->retention, a->token, now, &fence) :
				  idem_keys_reset(call, a->key, a->fingerprint, rec->fence,
								  a->lease, a->retention, a->token, now, &fence)))
				return false;
			set_out(r, OUT_FENCE, Int64GetDatum(fence));
			set_out(r, OUT_ATTEMPT, Int32GetDatum(1));
			set_out(r, OUT_CREATED_AT, TimestampTzGetDatum(now));
			break;
		case STEP_TAKEOVER:
			if (!idem_keys_takeover(call, a->key, rec->owner, rec->fence,
									a->lease, a->token, now, &t))
				return false;
			set_out(r, OUT_FENCE, Int64GetDatum(t.fence));
			set_out(r, OUT_ATTEMPT, Int32GetDatum(t.attempt));
			set_out_varlena(r, OUT_RECOVERY_POINT, t.recovery_point);
			set_out_varlena(r, OUT_RECOVERY_STATE, t.recovery_state);
			set_out(r, OUT_CREATED_AT, TimestampTzGetDatum(t.created_at));
			r->takeover = true;
			break;
		case STEP_ANSWER:
		case STEP_RESUME:
			elog(ERROR, "a claim's answer is not a write");
	}
	r->outcome = CLAIM_NEW;

	if (step == STEP_INSERT)
		return true;
	won = GetCurrentTimestamp();
	if (won - now > WRITE_DELAY_RESTAMP_US)
	{
		idem_keys_restamp(call, a->key, owner, DatumGetInt64(r->values[OUT_FENCE]), won,
						  step == STEP_TAKEOVER ? NULL : a->retention);
		if (step != STEP_TAKEOVER)
			set_out(r, OUT_CREATED_AT, TimestampTzGetDatum(won));
	}
	return true;
}

/*
 * Decides one claim.  When another transaction is writing the record (an
 * uncommitted claim or complete of the same key), a claim that must write,
 * or resume, waits for it and answers from what committed.  With
 * writer_timeout_ms >= 0 (the claim's `wait`) it first finds that
 * transaction and waits for it at most that long, then answers in_progress;
 * otherwise its write (or resumption) waits as long as lock_timeout allows.
 */
static void
claim_once(const ClaimArgs *a, IdemCall *call, long writer_timeout_ms, TimestampTz *now,
		   ClaimResult *r)
{
	bool		insert_failed = false;
	bool		resume_unwritten = false;

	for (int tries = 0; tries < CLAIM_MAX_TRIES; tries++)
	{
		IdemRecord	rec;
		bool		found;
		ClaimStep	step;

		memset(r->nulls, true, sizeof(r->nulls));
		r->takeover = false;
		r->resumed = false;

		found = idem_keys_fetch(call, a->key, a->fingerprint, *now, &rec);
		step = decide(&rec, found, a->token, call->caller, *now, r);

		/*
		 * An answer read from a record that a transaction committed after
		 * the snapshot has changed (completed, released, extended) would
		 * be stale: with the token, `new` for a request that completed.
		 */
		if ((step == STEP_ANSWER || step == STEP_RESUME) && rec.changed_since_snapshot)
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to concurrent update")));
		if (step == STEP_ANSWER)
			return;
		/* Beyond an answer read from the key index, or an insert that runs built-in code only: owner.c. */
		if (step != STEP_INSERT)
			idem_call_restrict(call);
		if (step == STEP_RESUME)
		{
			TransactionId writer;

			/* No transaction was writing the record before this read: answer. */
			if (resume_unwritten)
				return;
			writer = idem_keys_writer(call, a->key);
			if (TransactionIdIsValid(writer) && !idem_wait_for_xact(writer, writer_timeout_ms))
			{
				/* The fence is only ever handed out with `new`. */
				memset(r->nulls, true, sizeof(r->nulls));
				set_out(r, OUT_CREATED_AT, TimestampTzGetDatum(rec.created_at));
				r->outcome = CLAIM_IN_PROGRESS;
				r->resumed = false;
				r->lease_expires_at = DT_NOBEGIN;
				return;
			}
			/* A snapshot of the transaction could not see the write waited for. */
			if (TransactionIdIsValid(writer) && IsolationUsesXactSnapshot() &&
				TransactionIdDidCommit(writer))
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("could not serialize access due to concurrent update")));
			/* Read again, to see the write waited for, or one that committed before the check. */
			resume_unwritten = !TransactionIdIsValid(writer);
			*now = GetCurrentTimestamp();
			continue;
		}
		resume_unwritten = false;
		if (writer_timeout_ms >= 0)
		{
			TransactionId writer = idem_keys_writer(call, a->key);

			if (TransactionIdIsValid(writer))
			{
				if (!idem_wait_for_xact(writer, writer_timeout_ms))
				{
					r->outcome = CLAIM_IN_PROGRESS;
					r->lease_expires_at = DT_NOBEGIN;
					return;
				}
				*now = GetCurrentTimestamp();
				continue;
			}
		}
		/* The clock after the read, whatever lock it waited for: a lease starts when it is won. */
		*now = GetCurrentTimestamp();
		if (write_claim(step, a, call, &rec, *now, r))
			return;

		/*
		 * A concurrent transaction wrote the record first (committed, or
		 * still writing: then wait for it), or reap took it.  Under
		 * REPEATABLE READ or SERIALIZABLE, a second failed insert means a
		 * record committed that the snapshot cannot see: as INSERT ... ON
		 * CONFLICT would, fail.
		 */
		if (step == STEP_INSERT && IsolationUsesXactSnapshot() && insert_failed)
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to concurrent update")));
		insert_failed = (step == STEP_INSERT);
		if (writer_timeout_ms < 0)
		{
			TransactionId writer = idem_keys_writer(call, a->key);

			if (TransactionIdIsValid(writer))
				(void) idem_wait_for_xact(writer, -1);
		}
		*now = GetCurrentTimestamp();
	}
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not claim idempotency key \"%s\" because of concurrent updates",
					text_to_cstring(a->key)),
			 errhint("Retry the claim.")));
}

/* Whole seconds until the lease ends, at least 1 (1 when not known yet). */
static int32
retry_after_seconds(TimestampTz lease_expires_at, TimestampTz now)
{
	int64		secs;

	if (lease_expires_at == DT_NOBEGIN)
		return 1;
	secs = (lease_expires_at - now + USECS_PER_SEC - 1) / USECS_PER_SEC;
	return (int32) Max(1, Min(secs, PG_INT32_MAX));
}

/* Counts a claim's answer in the statistics. */
static void
count_claim(const ClaimResult *r, bool waited)
{
	static const IdemCounter counters[] = {
		IDEM_CLAIMS_NEW, IDEM_CLAIMS_REPLAY, IDEM_CLAIMS_IN_PROGRESS, IDEM_CLAIMS_MISMATCH
	};

	idem_stats_add(r->resumed ? IDEM_CLAIMS_RESUMED : counters[r->outcome], 1);
	if (r->takeover)
		idem_stats_add(IDEM_TAKEOVERS, 1);
	if (waited)
		idem_stats_add(IDEM_WAITS, 1);
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

/* Milliseconds left of a wait of wait_ms that started at start. */
static double
wait_left_ms(double wait_ms, instr_time start)
{
	instr_time	elapsed;

	INSTR_TIME_SET_CURRENT(elapsed);
	INSTR_TIME_SUBTRACT(elapsed, start);
	return wait_ms - INSTR_TIME_GET_MILLISEC(elapsed);
}

/*
 * Claims, and while the answer is in_progress and wait_ms lasts, waits: for
 * the transaction that is writing the record, if any (so that a prepared
 * complete is seen when it commits), else on the key's condition variable,
 * woken when a complete or release commits, or until the lease ends.
 * Returns whether it waited.
 */
static bool
claim_and_wait(const ClaimArgs *a, IdemCall *call, double wait_ms, TimestampTz *now,
			   ClaimResult *r)
{
	instr_time	start;
	bool		prepared = false;
	bool		waited = false;

	/* The wait is measured on the monotonic clock, immune to clock steps. */
	INSTR_TIME_SET_CURRENT(start);
	for (;;)
	{
		double		left_ms = wait_left_ms(wait_ms, start);
		double		lease_ms;
		TransactionId writer;

		claim_once(a, call, wait_ms > 0 ? (long) Max(left_ms, 0) : -1, now, r);
		left_ms = wait_left_ms(wait_ms, start);
		if (r->outcome != CLAIM_IN_PROGRESS || r->lease_expires_at == DT_NOBEGIN ||
			left_ms <= 0)
			break;
		if (!prepared)
		{
			idem_call_restrict(call);
			/* Look once more after registering, so no wake-up falls between. */
			idem_wait_prepare(a->keyhash);
			prepared = true;
			continue;
		}
		writer = idem_keys_writer(call, a->key);
		if (TransactionIdIsValid(writer))
		{
			waited = true;
			if (!idem_wait_for_xact(writer, (long) Max(left_ms, 1)))
				break;
			*now = GetCurrentTimestamp();
			continue;
		}
		lease_ms = (r->lease_expires_at - *now) / 1000.0 + 1;
		idem_wait_sleep(a->keyhash, (long) Max(1, Min(Min(left_ms, lease_ms), WAIT_MAX_SLEEP_MS)));
		waited = true;
		*now = GetCurrentTimestamp();
	}
	if (prepared)
		idem_wait_cancel();
	return waited;
}

/*
 * claim(key, fingerprint, scope, lease, retention, wait, token): decides
 * whether to run a request; with wait, an in_progress answer first waits for
 * up to that long; with token, a claim whose answer was lost is answered
 * again.
 */
Datum
idempotency_claim(PG_FUNCTION_ARGS)
{
	TimestampTz now = GetCurrentTimestamp();
	ClaimArgs	a;
	ClaimResult r;
	IdemCall	call;
	TupleDesc	tupdesc;
	double		wait_ms;
	bool		waited;

	a.key = idem_arg_key(fcinfo, 0);
	a.fingerprint = idem_arg_fingerprint(fcinfo, 1);
	a.scope = idem_arg_scope(fcinfo, 2);
	a.lease = idem_arg_lease(fcinfo, 3, now, true);
	a.retention = idem_arg_retention(fcinfo, 4, now);
	if (idem_interval_end(now, a.retention) < idem_interval_end(now, a.lease))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention must not be shorter than the lease"),
				 errdetail("A response stored at the end of the lease must still be there to be replayed.")));
	wait_ms = idem_arg_wait_ms(fcinfo, 5, now);
	a.token = idem_arg_token(fcinfo, 6);

	tupdesc = claim_result_desc(fcinfo);
	PreventCommandIfReadOnly("idempotency.claim()");

	/*
	 * Under REPEATABLE READ or SERIALIZABLE the snapshot would hide the
	 * owner's complete or release, so such a claim does not wait for them.
	 */
	if (IsolationUsesXactSnapshot())
		wait_ms = 0;

	/* A replay, a mismatch or an in_progress answer only reads the key index. */
	idem_call_begin_read(&call);
	idem_citus_locate(&call, "idempotency.claim()", a.scope, PG_ARGISNULL(2));
	/* Where a waiting claim sleeps: only a claim that may wait needs it. */
	a.keyhash = wait_ms > 0 ? idem_key_hash(&call.rel.scope, call.scope, a.key) : 0;
	idem_citus_floor_fences();
	waited = claim_and_wait(&a, &call, wait_ms, &now, &r);
	idem_call_end(&call);
	/* Whatever synchronous_commit says: the commit may never happen. */
	if (r.outcome == CLAIM_NEW && !r.resumed)
		idem_keys_flush_fence();

	if (r.outcome == CLAIM_IN_PROGRESS)
		set_out(&r, OUT_RETRY_AFTER,
				Int32GetDatum(retry_after_seconds(r.lease_expires_at, now)));
	set_out(&r, OUT_OUTCOME, CStringGetTextDatum(outcome_names[r.outcome]));
	count_claim(&r, waited);

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, r.values, r.nulls)));
}
