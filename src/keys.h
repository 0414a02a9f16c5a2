/*-------------------------------------------------------------------------
 * keys.h
 *	  The calls of the API and their statements on idempotency.keys, the
 *	  table of records (keys.c).
 *
 * Every read and write of a record goes through here, as the table's
 * owner, between idem_call_begin and idem_call_end, on the call's relation.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYS_H
#define IDEMPOTENCY_KEYS_H

#include "postgres.h"

#include "access/htup.h"
#include "datatype/timestamp.h"
#include "utils/jsonb.h"
#include "utils/uuid.h"

#include "catalog.h"
#include "owner.h"

/*
 * One call of the API: who called, the relation that holds the records it
 * works on, and what to restore when it ends.
 */
typedef struct IdemCall
{
	Oid			caller;			/* the role that called: its records are its own */
	IdemKeysRel rel;			/* idempotency.keys, unless citus.c chose a shard */
	Datum		scope;			/* the scope, as a value of rel's scope column */
	IdemOwnerSave owner_save;	/* the caller's user, context and settings */
	MemoryContext caller_cxt;	/* where results for the caller are copied */
} IdemCall;

/* What claim reads of the record of a (scope, key) that its caller may see. */
typedef struct IdemRecord
{
	Oid			owner;
	int64		fence;
	bool		completed;
	bool		same_fingerprint;
	TimestampTz lease_expires_at;	/* DT_NOBEGIN when NULL (completed) */
	TimestampTz expires_at;
	TimestampTz created_at;
	/*
	 * Under REPEATABLE READ or SERIALIZABLE: a transaction that committed
	 * after the snapshot was taken changed or deleted this record.
	 */
	bool		changed_since_snapshot;
	/* An in-progress record's claim token; then its attempt and recovery point too. */
	bool		has_token;
	pg_uuid_t	token;
	int32		attempt;
	text	   *recovery_point; /* NULL when none */
	Jsonb	   *recovery_state; /* NULL when none */
	/* The stored response: read for a completed record of the same fingerprint. */
	int32		status_code;
	Jsonb	   *headers;		/* NULL when none */
	bytea	   *body;			/* NULL when none */
} IdemRecord;

/* What a takeover hands to the new owner. */
typedef struct IdemTakeover
{
	int64		fence;
	int32		attempt;
	text	   *recovery_point; /* NULL when none */
	Jsonb	   *recovery_state; /* NULL when none */
	TimestampTz created_at;
} IdemTakeover;

extern void idem_call_begin(IdemCall *call);
extern void idem_call_begin_read(IdemCall *call);
extern void idem_call_restrict(IdemCall *call);
extern void idem_call_end(IdemCall *call);

extern struct varlena *idem_varlena_copy(Datum value, bool isnull, MemoryContext cxt);

extern bool idem_keys_reset(IdemCall *call, text *key, bytea *fingerprint,
							int64 old_fence, Interval *lease, Interval *retention,
							const pg_uuid_t *token, TimestampTz now, int64 *fence);
extern bool idem_keys_takeover(IdemCall *call, text *key, Oid owner,
							   int64 fence, Interval *lease, const pg_uuid_t *token,
							   TimestampTz now, IdemTakeover *result);
extern void idem_keys_restamp(IdemCall *call, text *key, Oid owner, int64 fence,
							  TimestampTz now, Interval *retention);

extern bool idem_keys_release(IdemCall *call, text *key, int64 fence);
extern bool idem_keys_extend(IdemCall *call, text *key, int64 fence,
							 Interval *lease, TimestampTz now, TimestampTz *ends);
extern bool idem_keys_checkpoint(IdemCall *call, text *key, int64 fence,
								 text *recovery_point, Jsonb *recovery_state,
								 TimestampTz now);
extern HeapTuple idem_keys_lookup(IdemCall *call, text *key, TimestampTz now);
extern uint64 idem_keys_reap(IdemCall *call, int batch, TimestampTz now);
extern bool idem_keys_insert_sql(IdemCall *call, text *key, bytea *fingerprint,
								 Interval *lease, TimestampTz now, TimestampTz expires_at,
								 TimestampTz lease_expires_at, const pg_uuid_t *token,
								 bool any_arbiter, int64 *fence);
extern bool idem_keys_complete_sql(IdemCall *call, text *key, int64 fence,
								   int32 status_code, Jsonb *headers, bytea *body,
								   TimestampTz now);

#endif							/* IDEMPOTENCY_KEYS_H */
