/*-------------------------------------------------------------------------
 * gauges.h
 *	  The live figures of idempotency.stats (records in progress and the
 *	  earliest end of their leases), kept in shared memory from the API's
 *	  own writes (gauges.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_GAUGES_H
#define IDEMPOTENCY_GAUGES_H

#include "postgres.h"

#include "datatype/timestamp.h"

extern void idem_gauges_init(void);
extern void idem_gauges_claimed(Oid relid, int64 fence, TimestampTz lease_end);
extern void idem_gauges_ended(Oid relid, int64 fence);
extern void idem_gauges_leased(Oid relid, int64 fence, TimestampTz lease_end);
extern bool idem_gauges_need_recount(Oid relid);
extern bool idem_gauges_recount(Oid relid);

#endif							/* IDEMPOTENCY_GAUGES_H */
