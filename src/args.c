/*-------------------------------------------------------------------------
 * args.c
 *	  Checks of the API's arguments, and their defaults from the settings.
 *
 * Every check raises before anything is written, with the design's
 * SQLSTATE: 22004 for a NULL where a value is required, 22023 for a value
 * out of its domain.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "compat.h"
#include "idempotency.h"

/*
 * Bounds on each field of an interval argument: 10000 years.  They keep
 * now + interval far from the end of the timestamp range, so that it can be
 * computed without overflow.
 */
#define MAX_INTERVAL_MONTHS (10000 * MONTHS_PER_YEAR)
#define MAX_INTERVAL_DAYS (10000 * 366)
#define MAX_INTERVAL_USECS (INT64CONST(10000) * 366 * USECS_PER_DAY)

/* Raises 22004 when argument argno, named name, is NULL. */
void
idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", name)));
}

/* Tells whether s holds a control character (C0, DEL, or C1 in UTF-8). */
static bool
has_control_chars(const unsigned char *s, int len)
{
	bool		utf8 = (GetDatabaseEncoding() == PG_UTF8);

	for (int i = 0; i < len; i++)
	{
		if (s[i] < 0x20 || s[i] == 0x7f)
			return true;
		if (utf8 && s[i] == 0xc2 && i + 1 < len && s[i + 1] >= 0x80 && s[i + 1] <= 0x9f)
			return true;
	}
	return false;
}

/* Returns the key argument: 1 to 255 bytes, no control characters. */
text *
idem_arg_key(FunctionCallInfo fcinfo, int argno)
{
	text	   *key;
	int			len;

	idem_require_arg(fcinfo, argno, "key");
	key = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(key);
	if (len < 1 || len > IDEM_MAX_KEY_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid idempotency key"),
				 errdetail("An idempotency key must be 1 to %d bytes long; this one has %d.",
						   IDEM_MAX_KEY_BYTES, len)));
	if (has_control_chars((const unsigned char *) VARDATA_ANY(key), len))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid idempotency key"),
				 errdetail("An idempotency key must not contain control characters.")));
	return key;
}

/*
 * Returns the scope argument, or the setting idempotency.scope when NULL.
 * With Citus, the argument can be an untyped literal, a C string, when the
 * records' scope has a tenant type other than text (citus.c).
 */
text *
idem_arg_scope(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope;
	int			len;

	if (PG_ARGISNULL(argno))
		scope = cstring_to_text(idem_scope ? idem_scope : "");
	else if (get_fn_expr_argtype(fcinfo->flinfo, argno) == UNKNOWNOID)
		scope = cstring_to_text(PG_GETARG_CSTRING(argno));
	else
		scope = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(scope);
	if (len > IDEM_MAX_SCOPE_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid scope"),
				 errdetail("A scope must be at most %d bytes long; this one has %d.",
						   IDEM_MAX_SCOPE_BYTES, len)));
	if (has_control_chars((const unsigned char *) VARDATA_ANY(scope), len))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid scope"),
				 errdetail("A scope must not contain control characters.")));
	return scope;
}

/* Returns the fence argument. */
int64
idem_arg_fence(FunctionCallInfo fcinfo, int argno)
{
	idem_require_arg(fcinfo, argno, "fence");
	return PG_GETARG_INT64(argno);
}

/* Returns the fingerprint argument: 1 to 64 bytes. */
bytea *
idem_arg_fingerprint(FunctionCallInfo fcinfo, int argno)
{
	bytea	   *fingerprint;
	int			len;

	idem_require_arg(fcinfo, argno, "fingerprint");
	fingerprint = PG_GETARG_BYTEA_PP(argno);
	len = VARSIZE_ANY_EXHDR(fingerprint);
	if (len < 1 || len > IDEM_MAX_FINGERPRINT_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid fingerprint"),
				 errdetail("A fingerprint must be 1 to %d bytes long; this one has %d.",
						   IDEM_MAX_FINGERPRINT_BYTES, len)));
	return fingerprint;
}

/* Returns from + span; the caller has checked that span is within bounds. */
TimestampTz
idem_interval_end(TimestampTz from, const Interval *span)
{
	return DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												   TimestampTzGetDatum(from),
												   IntervalPGetDatum(span)));
}

/*
 * Returns interval argument argno, named name, or a copy of *dflt when it
 * is NULL; raises 22023 when a field is beyond 10000 years.
 */
static Interval *
bounded_interval(FunctionCallInfo fcinfo, int argno, const char *name, const Interval *dflt)
{
	Interval   *span;

	if (PG_ARGISNULL(argno))
	{
		span = palloc(sizeof(Interval));
		*span = *dflt;
		return span;
	}
	span = PG_GETARG_INTERVAL_P(argno);
	if (Abs(span->month) > MAX_INTERVAL_MONTHS || Abs(span->day) > MAX_INTERVAL_DAYS ||
		span->time > MAX_INTERVAL_USECS || span->time < -MAX_INTERVAL_USECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" is out of range", name),
				 errdetail("Each field of the interval must be at most 10000 years.")));
	return span;
}

/* Tells whether no field of span is positive: then now + span is not later than now. */
static bool
interval_not_positive(const Interval *span)
{
	return span->month <= 0 && span->day <= 0 && span->time <= 0;
}

/*
 * Returns now + span, argument name, raising 22023 when PostgreSQL cannot
 * compute it (a time before 4713 BC on the way), instead of the 22008 that
 * the addition would raise.  Its negative fields, each at its longest
 * (31-day months, 25-hour days), must keep every step of the addition after
 * the earliest timestamp; its positive ones cannot overflow, each being at
 * most 10000 years (bounded_interval).
 */
static TimestampTz
arg_interval_end(TimestampTz now, const Interval *span, const char *name)
{
	int64		back = 0;

	if (span->month < 0)
		back += (int64) -span->month * 31 * USECS_PER_DAY;
	if (span->day < 0)
		back += (int64) -span->day * 25 * USECS_PER_HOUR;
	if (span->time < 0)
		back += -span->time;
	if (now - back < MIN_TIMESTAMP)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" is out of range", name),
				 errdetail("The interval must end at a time that PostgreSQL can represent.")));
	return idem_interval_end(now, span);
}

/* Raises 22023 unless now + span is later than now. */
static void
require_positive(const Interval *span, TimestampTz now, const char *name)
{
	if (interval_not_positive(span) || arg_interval_end(now, span, name) <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", name),
				 errdetail("The interval must end later than it starts, whatever its months and days add up to.")));
}

/*
 * Returns the lease argument, positive as elapsed time from now; when it is
 * NULL, idempotency.lease if default_setting, else NULL.
 */
Interval *
idem_arg_lease(FunctionCallInfo fcinfo, int argno, TimestampTz now, bool default_setting)
{
	Interval	dflt = {.time = (int64) idem_lease_ms * 1000};
	Interval   *lease;

	if (PG_ARGISNULL(argno) && !default_setting)
		return NULL;
	lease = bounded_interval(fcinfo, argno, "lease", &dflt);
	require_positive(lease, now, "lease");
	return lease;
}

/* Returns the retention argument, or idempotency.retention; positive from now. */
Interval *
idem_arg_retention(FunctionCallInfo fcinfo, int argno, TimestampTz now)
{
	Interval	dflt = {.time = (int64) idem_retention_s * USECS_PER_SEC};
	Interval   *retention = bounded_interval(fcinfo, argno, "retention", &dflt);

	require_positive(retention, now, "retention");
	return retention;
}

/* Returns the wait argument in milliseconds from now: 0 when NULL; never negative. */
double
idem_arg_wait_ms(FunctionCallInfo fcinfo, int argno, TimestampTz now)
{
	Interval	none = {0};
	Interval   *wait = bounded_interval(fcinfo, argno, "wait", &none);
	bool		zero = (wait->month == 0 && wait->day == 0 && wait->time == 0);
	TimestampTz end;

	if (interval_not_positive(wait) && !zero)
		end = DT_NOBEGIN;		/* earlier than now, known without computing it */
	else
		end = arg_interval_end(now, wait, "wait");
	if (end < now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must not be negative", "wait")));
	return (double) (end - now) / 1000.0;
}

/*
 * Returns the token argument, NULL when it is NULL or absent (claim of
 * version 1.1, whose SQL function has no such argument).
 */
pg_uuid_t *
idem_arg_token(FunctionCallInfo fcinfo, int argno)
{
	if (PG_NARGS() <= argno || PG_ARGISNULL(argno))
		return NULL;
	return PG_GETARG_UUID_P(argno);
}
