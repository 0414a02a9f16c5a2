/*-------------------------------------------------------------------------
 * fence.h
 *	  Fences: drawn from idempotency.fence_seq, made durable (fence.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_FENCE_H
#define IDEMPOTENCY_FENCE_H

#include "postgres.h"

extern void idem_fence_init(void);
extern int64 idem_keys_next_fence(int64 at_least);
extern void idem_keys_flush_fence(void);

#endif							/* IDEMPOTENCY_FENCE_H */
