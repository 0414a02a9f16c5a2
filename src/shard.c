/*-------------------------------------------------------------------------
 * shard.c
 *	  shard_hash() and shard_of(): which shard holds a scope's records.
 *
 * The rule is fixed forever, because applications in other languages and
 * routers outside the database compute it too: the first 4 bytes of the
 * SHA-256 of the scope's UTF-8 bytes, read as a signed big-endian 32-bit
 * integer; a cluster of n shards (a power of two) puts the scope on shard
 * hash & (n - 1), as PL/Proxy's RUN ON does.  Not hashtext(), whose result
 * is PostgreSQL's own and has changed between major versions.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <openssl/evp.h>

#include "fmgr.h"
#include "mb/pg_wchar.h"

#include "args.h"
#include "compat.h"

/* The most shards a cluster may have: PL/Proxy's partitions are far fewer. */
#define MAX_SHARDS 65536

PG_FUNCTION_INFO_V1(idempotency_shard_hash);
PG_FUNCTION_INFO_V1(idempotency_shard_of);

/* Returns the shard hash of len bytes of UTF-8 text. */
static int32
shard_hash_bytes(const char *data, size_t len)
{
	unsigned char digest[EVP_MAX_MD_SIZE];
	unsigned int digest_len = 0;

	/* The one-shot EVP call allocates nothing that an error could leak. */
	if (EVP_Digest(data, len, digest, &digest_len, EVP_sha256(), NULL) != 1 ||
		digest_len < 4)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not compute SHA-256 digest")));
	return (int32) (((uint32) digest[0] << 24) | ((uint32) digest[1] << 16) |
					((uint32) digest[2] << 8) | (uint32) digest[3]);
}

/* Returns the shard hash of the scope argument, read as UTF-8 whatever the database encoding. */
static int32
scope_hash(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope;
	char	   *utf8;
	int			len;

	idem_require_arg(fcinfo, argno, "scope");
	scope = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(scope);
	utf8 = pg_server_to_any(VARDATA_ANY(scope), len, PG_UTF8);
	if (utf8 != VARDATA_ANY(scope))
		len = strlen(utf8);
	return shard_hash_bytes(utf8, len);
}

/* shard_hash(scope): the scope's 32-bit shard hash, as PL/Proxy's RUN ON takes it. */
Datum
idempotency_shard_hash(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(scope_hash(fcinfo, 0));
}

/* shard_of(scope, shards): the shard, 0 to shards - 1, that holds the scope. */
Datum
idempotency_shard_of(PG_FUNCTION_ARGS)
{
	int32		shards;
	int32		hash;

	hash = scope_hash(fcinfo, 0);
	idem_require_arg(fcinfo, 1, "shards");
	shards = PG_GETARG_INT32(1);
	if (shards < 1 || shards > MAX_SHARDS || (shards & (shards - 1)) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid number of shards: %d", shards),
				 errdetail("The number of shards must be a power of two from 1 to %d.",
						   MAX_SHARDS)));
	PG_RETURN_INT32(hash & (shards - 1));
}
