/*-------------------------------------------------------------------------
 * args.h
 *	  Checks of the API's arguments, and their defaults (args.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_ARGS_H
#define IDEMPOTENCY_ARGS_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "fmgr.h"
#include "utils/uuid.h"

extern void idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name);
extern text *idem_arg_key(FunctionCallInfo fcinfo, int argno);
extern text *idem_arg_scope(FunctionCallInfo fcinfo, int argno);
extern int64 idem_arg_fence(FunctionCallInfo fcinfo, int argno);
extern bytea *idem_arg_fingerprint(FunctionCallInfo fcinfo, int argno);
extern Interval *idem_arg_lease(FunctionCallInfo fcinfo, int argno, TimestampTz now,
								bool default_setting);
extern Interval *idem_arg_retention(FunctionCallInfo fcinfo, int argno, TimestampTz now);
extern double idem_arg_wait_ms(FunctionCallInfo fcinfo, int argno, TimestampTz now);
extern pg_uuid_t *idem_arg_token(FunctionCallInfo fcinfo, int argno);
extern TimestampTz idem_interval_end(TimestampTz from, const Interval *span);

#endif							/* IDEMPOTENCY_ARGS_H */
