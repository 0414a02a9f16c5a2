/*-------------------------------------------------------------------------
 * reaper.h
 *	  The background reaper and reap() (reaper.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_REAPER_H
#define IDEMPOTENCY_REAPER_H

extern void idem_reaper_init(void);

#endif							/* IDEMPOTENCY_REAPER_H */
