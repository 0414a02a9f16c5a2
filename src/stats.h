/*-------------------------------------------------------------------------
 * stats.h
 *	  Counters of the idempotency.stats view, in shared memory (stats.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_STATS_H
#define IDEMPOTENCY_STATS_H

#include "postgres.h"

#include "datatype/timestamp.h"

typedef enum IdemCounter
{
	IDEM_CLAIMS_NEW,
	IDEM_CLAIMS_REPLAY,
	IDEM_CLAIMS_IN_PROGRESS,
	IDEM_CLAIMS_MISMATCH,
	IDEM_TAKEOVERS,
	IDEM_WAITS,
	IDEM_COMPLETES_STORED,
	IDEM_COMPLETES_RELEASED,
	IDEM_RELEASES,
	IDEM_FENCE_REJECTIONS,
	IDEM_REAPED,
	IDEM_REAPER_RUNS,
	IDEM_CLAIMS_RESUMED,		/* 1.2: the last column of _stats_counters */
	IDEM_NUM_COUNTERS
} IdemCounter;

extern void idem_stats_init(void);
extern void idem_stats_add(IdemCounter counter, uint64 n);
extern void idem_stats_set_last_reap(TimestampTz at);
extern void idem_stats_reap_failed(const char *dbname, const char *message);
extern void idem_stats_reap_succeeded(const char *dbname);

#endif							/* IDEMPOTENCY_STATS_H */
