/*-------------------------------------------------------------------------
 * keysread.h
 *	  The reads of idempotency.keys without the executor (keysread.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYSREAD_H
#define IDEMPOTENCY_KEYSREAD_H

#include "executor/tuptable.h"
#include "utils/rel.h"
#include "utils/snapshot.h"

#include "keys.h"

extern bool idem_keys_fetch(IdemCall *call, text *key, bytea *fingerprint,
							TimestampTz now, IdemRecord *rec);
extern TransactionId idem_keys_writer(IdemCall *call, text *key);
extern bool idem_keys_find_claim(IdemCall *call, Relation rel, Snapshot snapshot, text *key,
								 int64 fence, TimestampTz now, ItemPointer hint,
								 TupleTableSlot *slot);

#endif							/* IDEMPOTENCY_KEYSREAD_H */
