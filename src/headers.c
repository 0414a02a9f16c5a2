/*-------------------------------------------------------------------------
 * headers.c
 *	  The response headers that complete stores: checked as HTTP, and
 *	  without those of idempotency.header_denylist.
 *
 * A stored header is replayed into a response by a middleware that may
 * copy it as it is: a name must be an HTTP token (RFC 9110) and a value
 * must hold no CR, LF or NUL, or a client could inject headers of its own.
 * Credentials and cookies are never stored, to be replayed to nobody.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/jsonb.h"

#include "compat.h"
#include "guclist.h"
#include "headers.h"

/* The setting, and the list parsed from it when it was set. */
char	   *idem_header_denylist = NULL;
static const IdemNameList *denylist = NULL;

/* Check hook of idempotency.header_denylist: parses the list once, when it is set. */
bool
idem_denylist_check(char **newval, void **extra, GucSource source)
{
	return idem_name_list_parse(*newval, "idempotency.header_denylist", false, extra);
}

/* Assign hook of idempotency.header_denylist: installs the parsed list. */
void
idem_denylist_assign(const char *newval, void *extra)
{
	denylist = (const IdemNameList *) extra;
}

/* Tells whether a header name is in idempotency.header_denylist (any case). */
static bool
header_denied(const char *name, int len)
{
	return idem_name_list_contains(denylist, name, len, true);
}

/* Tells whether c may appear in an HTTP token (RFC 9110 tchar). */
static bool
is_tchar(unsigned char c)
{
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		(c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* Raises 22023 unless name is an HTTP token. */
static void
check_header_name(const char *name, int len)
{
	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid response header name \"\""),
				 errdetail("A header name must not be empty.")));
	for (int i = 0; i < len; i++)
		if (!is_tchar((unsigned char) name[i]))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid response header name \"%s\"", pnstrdup(name, len)),
					 errdetail("A header name must be an HTTP token: letters, digits and !#$%%&'*+-.^_`|~ only.")));
}

/* Raises 22023 when a header value string holds CR, LF or NUL. */
static void
check_header_string(const char *name, int name_len, const JsonbValue *v)
{
	for (int i = 0; i < v->val.string.len; i++)
	{
		char		c = v->val.string.val[i];

		if (c == '\r' || c == '\n' || c == '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid value of response header \"%s\"", pnstrdup(name, name_len)),
					 errdetail("A header value must not contain CR, LF or NUL characters.")));
	}
}

/* Raises 22023 for a header value of the wrong shape. */
static void
bad_header_value(const char *name, int name_len)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("invalid value of response header \"%s\"", pnstrdup(name, name_len)),
			 errdetail("A header value must be a string or an array of strings.")));
}

/* Checks a header value: a string, or an array of strings, each valid HTTP. */
static void
check_header_value(const char *name, int name_len, JsonbValue *v)
{
	JsonbIterator *it;
	JsonbValue	elem;
	JsonbIteratorToken tok;

	if (v->type == jbvString)
	{
		check_header_string(name, name_len, v);
		return;
	}
	if (v->type != jbvBinary || !JsonContainerIsArray(v->val.binary.data))
		bad_header_value(name, name_len);
	it = JsonbIteratorInit(v->val.binary.data);
	while ((tok = JsonbIteratorNext(&it, &elem, true)) != WJB_DONE)
	{
		if (tok != WJB_ELEM)
			continue;
		if (elem.type != jbvString)
			bad_header_value(name, name_len);
		check_header_string(name, name_len, &elem);
	}
}

/*
 * Checks headers (a JSON object whose names are HTTP tokens and whose
 * values are strings or arrays of strings without CR, LF or NUL) and
 * returns them without the denied ones.
 */
Jsonb *
idem_headers_filter(Jsonb *headers)
{
	JsonbIterator *it;
	JsonbValue	k;
	JsonbValue	v;
	JsonbIteratorToken tok;
	IdemJsonbState state = IDEM_JSONB_STATE_INIT;
	JsonbValue *res;
	bool		dropped = false;

	if (!JB_ROOT_IS_OBJECT(headers) || JB_ROOT_IS_SCALAR(headers))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid response headers"),
				 errdetail("Headers must be a JSON object.")));

	/* First pass: check every header and see whether any is denied. */
	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &k, true)) != WJB_DONE)
	{
		if (tok != WJB_KEY)
			continue;
		(void) JsonbIteratorNext(&it, &v, true);
		check_header_name(k.val.string.val, k.val.string.len);
		check_header_value(k.val.string.val, k.val.string.len, &v);
		if (header_denied(k.val.string.val, k.val.string.len))
			dropped = true;
	}
	if (!dropped)
		return headers;

	/* Second pass: rebuild the object without the denied headers. */
	it = JsonbIteratorInit(&headers->root);
	(void) idem_push_jsonb(&state, WJB_BEGIN_OBJECT, NULL);
	while ((tok = JsonbIteratorNext(&it, &k, true)) != WJB_DONE)
	{
		if (tok != WJB_KEY)
			continue;
		(void) JsonbIteratorNext(&it, &v, true);
		if (header_denied(k.val.string.val, k.val.string.len))
			continue;
		(void) idem_push_jsonb(&state, WJB_KEY, &k);
		(void) idem_push_jsonb(&state, WJB_VALUE, &v);
	}
	res = idem_push_jsonb(&state, WJB_END_OBJECT, NULL);
	return JsonbValueToJsonb(res);
}
