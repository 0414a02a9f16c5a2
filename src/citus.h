/*-------------------------------------------------------------------------
 * citus.h
 *	  idempotency.keys distributed by scope with Citus (citus.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_CITUS_H
#define IDEMPOTENCY_CITUS_H

#include "postgres.h"

#include "nodes/pg_list.h"

#include "keys.h"

extern void idem_citus_init(void);
extern void idem_citus_locate(IdemCall *call, const char *function, text *scope,
							  bool scope_omitted);
extern void idem_citus_floor_fences(void);
extern List *idem_citus_local_rels(void);

#endif							/* IDEMPOTENCY_CITUS_H */
