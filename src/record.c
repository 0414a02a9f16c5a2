/*-------------------------------------------------------------------------
 * record.c
 *	  The API on a claimed record: complete, release, extend and checkpoint,
 *	  which only the fence of the claim's current owner may call, and
 *	  lookup.
 *
 * A fence that no longer owns the claim (taken over, released, completed,
 * reaped), or a record the caller's role does not see, changes nothing:
 * IK001, or false for release.  Everything a record stores is checked and
 * bounded before anything is written.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "args.h"
#include "citus.h"
#include "headers.h"
#include "idempotency.h"
#include "keys.h"
#include "keyswrite.h"
#include "stats.h"
#include "wait.h"

PG_FUNCTION_INFO_V1(idempotency_complete);
PG_FUNCTION_INFO_V1(idempotency_release);
PG_FUNCTION_INFO_V1(idempotency_extend);
PG_FUNCTION_INFO_V1(idempotency_checkpoint);
PG_FUNCTION_INFO_V1(idempotency_lookup);

/* Raises IK001: the fence no longer owns the claim. */
static void
fence_lost(text *key)
{
	idem_stats_add(IDEM_FENCE_REJECTIONS, 1);
	ereport(ERROR,
			(errcode(ERRCODE_FENCE_LOST),
			 errmsg("this fence no longer owns idempotency key \"%s\"",
					text_to_cstring(key)),
			 errdetail("The claim was taken over, released, completed or expired."),
			 errhint("Do not send this response: another attempt owns the request.")));
}

/* Returns the size of a varlena datum's data, as stored uncompressed; 0 for NULL. */
static Size
data_size(Datum value, bool isnull)
{
	return isnull ? 0 : toast_raw_datum_size(value) - VARHDRSZ;
}

/* Raises 54000 when a response of size bytes is over idempotency.max_response_bytes. */
static void
check_response_size(Size size)
{
	if (size > (Size) idem_max_response_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response is too large"),
				 errdetail("The body and headers have %zu bytes; idempotency.max_response_bytes allows %d.",
						   size, idem_max_response_bytes)));
}

/* Raises 54000 when a recovery point and state of size bytes are over the limit. */
static void
check_recovery_size(Size size)
{
	if (size > (Size) idem_max_response_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("recovery point is too large"),
				 errdetail("The recovery point and state have %zu bytes; idempotency.max_response_bytes allows %d.",
						   size, idem_max_response_bytes)));
}

/*
 * complete(key, fence, status_code, body, headers, scope): stores the
 * response and ends the claim; a 5xx releases it instead (unless
 * idempotency.store_server_errors), whatever its body and headers.  IK001
 * when the fence lost the claim.
 */
Datum
idempotency_complete(PG_FUNCTION_ARGS)
{
	text	   *key = idem_arg_key(fcinfo, 0);
	int64		fence = idem_arg_fence(fcinfo, 1);
	text	   *scope = idem_arg_scope(fcinfo, 5);
	int32		status_code;
	bytea	   *body = NULL;
	Jsonb	   *headers = NULL;
	bool		release;
	IdemCall	call;
	bool		owned;

	idem_require_arg(fcinfo, 2, "status_code");
	status_code = PG_GETARG_INT32(2);
	if (status_code < 100 || status_code > 599)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status code %d is out of range", status_code),
				 errdetail("An HTTP status code is between 100 and 599.")));
	/* A 5xx that is released is not stored: its body and headers are not checked. */
	release = status_code >= 500 && !idem_store_server_errors;
	if (!release)
	{
		if (!PG_ARGISNULL(4))
			headers = idem_headers_filter(PG_GETARG_JSONB_P(4));
		check_response_size(data_size(PG_GETARG_DATUM(3), PG_ARGISNULL(3)) +
							(headers ? VARSIZE(headers) - VARHDRSZ : 0));
		if (!PG_ARGISNULL(3))
			body = PG_GETARG_BYTEA_P(3);
	}
	PreventCommandIfReadOnly("idempotency.complete()");

	/* The search_path is restricted where the write may run code not built in (keysindex.c). */
	idem_call_begin_read(&call);
	idem_citus_locate(&call, "idempotency.complete()", scope, PG_ARGISNULL(5));
	if (release)
		owned = idem_keys_release(&call, key, fence);
	else
		owned = idem_keys_complete(&call, key, fence, status_code, headers, body,
								   GetCurrentTimestamp());
	idem_call_end(&call);

	if (!owned)
		fence_lost(key);
	idem_wait_wake_at_commit(idem_key_hash(&call.rel.scope, call.scope, key));
	idem_stats_add(release ? IDEM_COMPLETES_RELEASED : IDEM_COMPLETES_STORED, 1);
	PG_RETURN_TEXT_P(cstring_to_text(release ? "released" : "stored"));
}

/* release(key, fence, scope): deletes the claim so that a retry runs again. */
Datum
idempotency_release(PG_FUNCTION_ARGS)
{
	text	   *key = idem_arg_key(fcinfo, 0);
	int64		fence = idem_arg_fence(fcinfo, 1);
	text	   *scope = idem_arg_scope(fcinfo, 2);
	IdemCall	call;
	bool		released;

	PreventCommandIfReadOnly("idempotency.release()");
	idem_call_begin(&call);
	idem_citus_locate(&call, "idempotency.release()", scope, PG_ARGISNULL(2));
	released = idem_keys_release(&call, key, fence);
	idem_call_end(&call);

	if (released)
	{
		idem_wait_wake_at_commit(idem_key_hash(&call.rel.scope, call.scope, key));
		idem_stats_add(IDEM_RELEASES, 1);
	}
	else
		idem_stats_add(IDEM_FENCE_REJECTIONS, 1);
	PG_RETURN_BOOL(released);
}

/*
 * extend(key, fence, lease, scope): renews the lease; returns its new end.
 * A lease never ends earlier than it did, also after the clock stepped back.
 */
Datum
idempotency_extend(PG_FUNCTION_ARGS)
{
	TimestampTz now = GetCurrentTimestamp();
	text	   *key = idem_arg_key(fcinfo, 0);
	int64		fence = idem_arg_fence(fcinfo, 1);
	Interval   *lease = idem_arg_lease(fcinfo, 2, now, false);
	text	   *scope = idem_arg_scope(fcinfo, 3);
	IdemCall	call;
	TimestampTz ends = 0;
	bool		owned;

	PreventCommandIfReadOnly("idempotency.extend()");
	idem_call_begin(&call);
	idem_citus_locate(&call, "idempotency.extend()", scope, PG_ARGISNULL(3));
	owned = idem_keys_extend(&call, key, fence, lease, now, &ends);
	idem_call_end(&call);

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
	text	   *key = idem_arg_key(fcinfo, 0);
	int64		fence = idem_arg_fence(fcinfo, 1);
	text	   *scope = idem_arg_scope(fcinfo, 4);
	text	   *point;
	Jsonb	   *state = NULL;
	IdemCall	call;
	bool		owned;

	idem_require_arg(fcinfo, 2, "recovery_point");
	check_recovery_size(data_size(PG_GETARG_DATUM(2), false) +
						data_size(PG_GETARG_DATUM(3), PG_ARGISNULL(3)));
	point = PG_GETARG_TEXT_P(2);
	if (!PG_ARGISNULL(3))
		state = PG_GETARG_JSONB_P(3);

	PreventCommandIfReadOnly("idempotency.checkpoint()");
	idem_call_begin(&call);
	idem_citus_locate(&call, "idempotency.checkpoint()", scope, PG_ARGISNULL(4));
	owned = idem_keys_checkpoint(&call, key, fence, point, state, GetCurrentTimestamp());
	idem_call_end(&call);

	if (!owned)
		fence_lost(key);
	PG_RETURN_VOID();
}

/*
 * lookup(key, scope): the record as claim would see it, without the fence;
 * no row when it is absent, expired or not the caller's to see.  Reads
 * only: works on a standby.
 */
Datum
idempotency_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = idem_arg_key(fcinfo, 0);
	text	   *scope = idem_arg_scope(fcinfo, 1);
	TupleDesc	tupdesc;
	Tuplestorestate *store;
	MemoryContext old;
	IdemCall	call;
	HeapTuple	tuple;

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

	idem_call_begin(&call);
	idem_citus_locate(&call, "idempotency.lookup()", scope, PG_ARGISNULL(1));
	tuple = idem_keys_lookup(&call, key, GetCurrentTimestamp());
	idem_call_end(&call);
	if (tuple)
		tuplestore_puttuple(store, tuple);

	rsinfo->returnMode = SFRM_Materialize;
	rsinfo->setResult = store;
	rsinfo->setDesc = tupdesc;
	return (Datum) 0;
}
