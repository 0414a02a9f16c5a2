/*-------------------------------------------------------------------------
 * keys.h
 *	  Access to idempotency.keys, the table of records (keys.c).
 *
 * Every read and write of a record goes through here, as the table's
 * owner, between idem_call_begin and idem_call_end.  Every write holds the
 * record's key lock until its transaction ends.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYS_H
#define IDEMPOTENCY_KEYS_H

#include "postgres.h"

#include "access/htup.h"
#include "datatype/timestamp.h"
#include "utils/jsonb.h"

/* One call of the API: who called, and what to restore when it ends. */
typedef struct IdemCall
{
	Oid			caller;			/* the role that called: its records are its own */
	Oid			save_userid;
	int			save_sec_context;
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

/* How idem_keys_lock got the key's lock. */
typedef enum IdemLockResult
{
	IDEM_LOCK_AT_ONCE,			/* nobody held it */
	IDEM_LOCK_AFTER_WAIT,		/* another transaction held it, and ended */
	IDEM_LOCK_TIMED_OUT			/* another transaction still holds it */
} IdemLockResult;

/* How idem_keys_wait_for_writer went. */
typedef enum IdemWriterWait
{
	IDEM_NO_WRITER,				/* nobody else holds the key lock */
	IDEM_WRITER_ENDED,			/* another transaction held it, and ended */
	IDEM_WRITER_STILL_THERE		/* it still holds it after the timeout */
} IdemWriterWait;

extern void idem_call_begin(IdemCall *call);
extern void idem_call_end(IdemCall *call);

extern uint64 idem_key_hash(text *scope, text *key);
extern IdemLockResult idem_keys_lock(uint64 keyhash, long timeout_ms);
extern IdemWriterWait idem_keys_wait_for_writer(uint64 keyhash, long timeout_ms);

extern bool idem_keys_fetch(IdemCall *call, text *scope, text *key, bytea *fingerprint,
							TimestampTz now, IdemRecord *rec);
extern bool idem_keys_insert(text *scope, text *key, Oid owner, bytea *fingerprint,
							 Interval *lease, Interval *retention, TimestampTz now,
							 int64 *fence);
extern bool idem_keys_reset(text *scope, text *key, Oid owner, bytea *fingerprint,
							Interval *lease, Interval *retention, TimestampTz now,
							int64 *fence);
extern bool idem_keys_takeover(IdemCall *call, text *scope, text *key, Oid owner,
							   int64 fence, Interval *lease, TimestampTz now,
							   IdemTakeover *result);
extern void idem_keys_flush_fence(void);

extern bool idem_keys_complete(IdemCall *call, text *scope, text *key, int64 fence,
							   int32 status_code, Jsonb *headers, bytea *body,
							   TimestampTz now);
extern bool idem_keys_release(IdemCall *call, text *scope, text *key, int64 fence);
extern bool idem_keys_extend(IdemCall *call, text *scope, text *key, int64 fence,
							 Interval *lease, TimestampTz now, TimestampTz *ends);
extern bool idem_keys_checkpoint(IdemCall *call, text *scope, text *key, int64 fence,
								 text *recovery_point, Jsonb *recovery_state,
								 TimestampTz now);
extern HeapTuple idem_keys_lookup(IdemCall *call, text *scope, text *key, TimestampTz now);
extern uint64 idem_keys_reap(int batch, TimestampTz now);

#endif							/* IDEMPOTENCY_KEYS_H */
