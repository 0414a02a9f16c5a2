/*-------------------------------------------------------------------------
 * keyswrite.h
 *	  Claim's insert and complete's update, without the executor
 *	  (keyswrite.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYSWRITE_H
#define IDEMPOTENCY_KEYSWRITE_H

#include "keys.h"

extern bool idem_keys_insert(IdemCall *call, text *key, bytea *fingerprint,
							 Interval *lease, Interval *retention, const pg_uuid_t *token,
							 TimestampTz now, int64 *fence);
extern bool idem_keys_complete(IdemCall *call, text *key, int64 fence,
							   int32 status_code, Jsonb *headers, bytea *body,
							   TimestampTz now);

#endif							/* IDEMPOTENCY_KEYSWRITE_H */
