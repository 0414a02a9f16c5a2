/*-------------------------------------------------------------------------
 * fingerprint.c
 *	  fingerprint() and fingerprint_json(): SHA-256 of a request.
 *
 * Each part is written as a presence byte, an 8-byte big-endian length and
 * the bytes, so that no two different requests share an encoding: ('a','bc')
 * and ('ab','c') differ, and a NULL body differs from an empty one.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <openssl/evp.h>

#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/formatting.h"
#include "utils/jsonb.h"

#include "args.h"

#define SHA256_LEN 32

PG_FUNCTION_INFO_V1(idempotency_fingerprint);
PG_FUNCTION_INFO_V1(idempotency_fingerprint_json);

/* Feeds one part (or its absence) to the digest. */
static void
digest_part(EVP_MD_CTX *ctx, const char *data, size_t len, bool present)
{
	unsigned char header[9];
	uint64		n = present ? len : 0;

	header[0] = present ? 1 : 0;
	for (int i = 8; i >= 1; i--)
	{
		header[i] = (unsigned char) (n & 0xff);
		n >>= 8;
	}
	if (EVP_DigestUpdate(ctx, header, sizeof(header)) != 1 ||
		(present && len > 0 && EVP_DigestUpdate(ctx, data, len) != 1))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not compute SHA-256 digest")));
}

/*
 * Hashes method (upper-cased), path, body and query; body or query may be
 * NULL (absent).  Returns a 32-byte bytea.
 */
static bytea *
fingerprint_parts(text *method, text *path, const char *body, size_t body_len,
				  bool has_body, text *query)
{
	char	   *upper = asc_toupper(VARDATA_ANY(method), VARSIZE_ANY_EXHDR(method));
	bytea	   *result = palloc(VARHDRSZ + SHA256_LEN);
	unsigned int out_len = 0;
	EVP_MD_CTX *ctx = EVP_MD_CTX_new();

	if (ctx == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	PG_TRY();
	{
		if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
			ereport(ERROR,
					(errcode(ERRCODE_INTERNAL_ERROR),
					 errmsg("could not initialize SHA-256 digest")));
		digest_part(ctx, upper, strlen(upper), true);
		digest_part(ctx, VARDATA_ANY(path), VARSIZE_ANY_EXHDR(path), true);
		digest_part(ctx, body, body_len, has_body);
		digest_part(ctx, query ? VARDATA_ANY(query) : NULL,
					query ? VARSIZE_ANY_EXHDR(query) : 0, query != NULL);
		if (EVP_DigestFinal_ex(ctx, (unsigned char *) VARDATA(result), &out_len) != 1 ||
			out_len != SHA256_LEN)
			ereport(ERROR,
					(errcode(ERRCODE_INTERNAL_ERROR),
					 errmsg("could not finish SHA-256 digest")));
	}
	PG_FINALLY();
	{
		EVP_MD_CTX_free(ctx);
	}
	PG_END_TRY();

	SET_VARSIZE(result, VARHDRSZ + SHA256_LEN);
	return result;
}

/* fingerprint(method, path, body, query): SHA-256 of a request. */
Datum
idempotency_fingerprint(PG_FUNCTION_ARGS)
{
	bytea	   *body = PG_ARGISNULL(2) ? NULL : PG_GETARG_BYTEA_PP(2);

	idem_require_arg(fcinfo, 0, "method");
	idem_require_arg(fcinfo, 1, "path");
	PG_RETURN_BYTEA_P(fingerprint_parts(PG_GETARG_TEXT_PP(0), PG_GETARG_TEXT_PP(1),
										body ? VARDATA_ANY(body) : NULL,
										body ? VARSIZE_ANY_EXHDR(body) : 0,
										body != NULL,
										PG_ARGISNULL(3) ? NULL : PG_GETARG_TEXT_PP(3)));
}

/*
 * fingerprint_json(method, path, body, query): the fingerprint of the body's
 * canonical text (jsonb's output: keys sorted, duplicates merged, whitespace
 * fixed), so it equals fingerprint() of that text.
 */
Datum
idempotency_fingerprint_json(PG_FUNCTION_ARGS)
{
	char	   *canonical = NULL;

	idem_require_arg(fcinfo, 0, "method");
	idem_require_arg(fcinfo, 1, "path");
	if (!PG_ARGISNULL(2))
	{
		Jsonb	   *body = PG_GETARG_JSONB_P(2);

		canonical = JsonbToCString(NULL, &body->root, VARSIZE(body));
	}
	PG_RETURN_BYTEA_P(fingerprint_parts(PG_GETARG_TEXT_PP(0), PG_GETARG_TEXT_PP(1),
										canonical,
										canonical ? strlen(canonical) : 0,
										canonical != NULL,
										PG_ARGISNULL(3) ? NULL : PG_GETARG_TEXT_PP(3)));
}
