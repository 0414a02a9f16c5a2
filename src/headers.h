/*-------------------------------------------------------------------------
 * headers.h
 *	  The response headers that complete stores (headers.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_HEADERS_H
#define IDEMPOTENCY_HEADERS_H

#include "postgres.h"

#include "utils/guc.h"
#include "utils/jsonb.h"

extern char *idem_header_denylist;

extern bool idem_denylist_check(char **newval, void **extra, GucSource source);
extern void idem_denylist_assign(const char *newval, void *extra);
extern Jsonb *idem_headers_filter(Jsonb *headers);

#endif							/* IDEMPOTENCY_HEADERS_H */
