/*-------------------------------------------------------------------------
 * idempotency.h
 *	  Declarations shared by the parts of the idempotency extension.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "fmgr.h"

/* Settings (defined in idempotency.c, one block with their rationale) */
extern int	idem_lease_ms;
extern int	idem_retention_s;
extern char *idem_scope;
extern int	idem_max_response_bytes;
extern bool idem_store_server_errors;
extern char *idem_header_denylist;
extern int	idem_reaper_naptime_s;
extern int	idem_reaper_batch;
extern char *idem_reaper_databases;

/* Raises 22004 when argument argno, named name, is NULL (idempotency.c). */
extern void require_arg(FunctionCallInfo fcinfo, int argno, const char *name);

/* Counters kept in shared memory when the library is preloaded (stats.c) */
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
	IDEM_NUM_COUNTERS
} IdemCounter;

extern void stats_shmem_request(void);
extern void stats_shmem_startup(void);
extern bool stats_available(void);
extern void stats_add(IdemCounter counter, uint64 n);
extern void stats_set_last_reap(TimestampTz at);
extern void stats_set_reap_error(const char *message);

/* Waiting for a claim to end: shared condition variables (stats.c) */
extern bool wait_sleep(uint32 keyhash, long timeout_ms);
extern void wait_prepare(uint32 keyhash);
extern void wait_cancel(void);
extern void wait_wake_at_commit(uint32 keyhash);

/*
 * Deletes up to batch expired records, oldest first, skipping locked rows,
 * and returns how many.  The caller must be in a transaction with an active
 * snapshot; SPI is connected and finished inside.  Used by reap() and by the
 * background worker.
 */
extern uint64 reap_expired(int batch);

/* The background reaper (reaper.c) */
extern void reaper_register(void);

#endif							/* IDEMPOTENCY_H */
