/*-------------------------------------------------------------------------
 * keysheap.h
 *	  The hot paths to idempotency.keys, without the executor (keysheap.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYSHEAP_H
#define IDEMPOTENCY_KEYSHEAP_H

#include "keys.h"

extern bool idem_keys_fetch(IdemCall *call, text *key, bytea *fingerprint,
							TimestampTz now, IdemRecord *rec);
extern TransactionId idem_keys_writer(IdemCall *call, text *key);
extern bool idem_keys_insert(IdemCall *call, text *key, bytea *fingerprint,
							 Interval *lease, Interval *retention, const pg_uuid_t *token,
							 TimestampTz now, int64 *fence);
extern bool idem_keys_complete(IdemCall *call, text *key, int64 fence,
							   int32 status_code, Jsonb *headers, bytea *body,
							   TimestampTz now);

#endif							/* IDEMPOTENCY_KEYSHEAP_H */
