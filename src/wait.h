/*-------------------------------------------------------------------------
 * wait.h
 *	  Claims that wait for an owner to finish, and their wake-ups (wait.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_WAIT_H
#define IDEMPOTENCY_WAIT_H

#include "postgres.h"

#include "catalog.h"

extern void idem_wait_init(void);
extern void idem_wait_prepare(uint64 keyhash);
extern void idem_wait_sleep(uint64 keyhash, long timeout_ms);
extern void idem_wait_cancel(void);
extern void idem_wait_wake_at_commit(uint64 keyhash);
extern uint64 idem_key_hash(const IdemScopeType *type, Datum scope, text *key);
extern bool idem_wait_for_xact(TransactionId xid, long timeout_ms);

#endif							/* IDEMPOTENCY_WAIT_H */
