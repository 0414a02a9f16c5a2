/*-------------------------------------------------------------------------
 * idempotency.h
 *	  Settings and limits of the SQL API, shared by its parts.
 *
 * The settings are defined in idempotency.c; the reaper defines its own.
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

/* SQLSTATE IK001: the fence no longer owns the claim. */
#define ERRCODE_FENCE_LOST MAKE_SQLSTATE('I','K','0','0','1')
/* SQLSTATE IK002: with Citus, another node holds the scope's records. */
#define ERRCODE_WRONG_NODE MAKE_SQLSTATE('I','K','0','0','2')

#define IDEM_MAX_KEY_BYTES 255
#define IDEM_MAX_SCOPE_BYTES 255
#define IDEM_MAX_FINGERPRINT_BYTES 64

extern int	idem_lease_ms;
extern int	idem_retention_s;
extern char *idem_scope;
extern int	idem_max_response_bytes;
extern bool idem_store_server_errors;

#endif							/* IDEMPOTENCY_H */
