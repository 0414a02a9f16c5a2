/*-------------------------------------------------------------------------
 * catalog.h
 *	  What the extension knows of its own objects: the columns of
 *	  idempotency.keys and their types, its owner, the fence sequence, the
 *	  values of idempotency.state (catalog.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_CATALOG_H
#define IDEMPOTENCY_CATALOG_H

#include "postgres.h"

#include "utils/relcache.h"

/* The columns of idempotency.keys. */
typedef enum IdemKeysColumn
{
	IDEM_COL_FENCE,
	IDEM_COL_CREATED_AT,
	IDEM_COL_EXPIRES_AT,
	IDEM_COL_LEASE_EXPIRES_AT,
	IDEM_COL_COMPLETED_AT,
	IDEM_COL_LEASE,
	IDEM_COL_ATTEMPT,
	IDEM_COL_STATUS_CODE,
	IDEM_COL_STATE,
	IDEM_COL_OWNER,
	IDEM_COL_SCOPE,
	IDEM_COL_KEY,
	IDEM_COL_FINGERPRINT,
	IDEM_COL_RECOVERY_POINT,
	IDEM_COL_RECOVERY_STATE,
	IDEM_COL_HEADERS,
	IDEM_COL_BODY,
	IDEM_COL_TOKEN,				/* from 1.2: InvalidAttrNumber in att[] before */
	IDEM_NUM_COLS
} IdemKeysColumn;

/* Whether an IdemKeysRel has claim's token column (1.2). */
#define IDEM_HAS_TOKEN(rel) ((rel)->att[IDEM_COL_TOKEN] != InvalidAttrNumber)

/*
 * The type of the scope column: text COLLATE "C" as the extension makes it,
 * or, where Citus colocates the records with a business table
 * (citus_distribute), the type and collation of that table's tenant column
 * (bigint, integer, uuid, text or varchar of any collation).
 */
typedef struct IdemScopeType
{
	Oid			type;
	Oid			collation;		/* InvalidOid for a type without collation */
	bool		is_text;		/* text or varchar: the scope's text is the value */
	RegProcedure eq;			/* the equality of its default btree operator class */
	Oid			input;			/* its input function and its argument, for the others */
	Oid			ioparam;
} IdemScopeType;

/* Room for a qualified, quoted relation name. */
#define IDEM_REL_NAME_SIZE (2 * NAMEDATALEN + 8)

/*
 * A relation that holds records: idempotency.keys itself, or, when Citus
 * distributes it, one of its shards (whose column numbers may differ).
 */
typedef struct IdemKeysRel
{
	Oid			relid;
	char		name[IDEM_REL_NAME_SIZE];	/* qualified and quoted, for the SPI plans */
	AttrNumber	att[IDEM_NUM_COLS];
	IdemScopeType scope;		/* the type of its scope column */
} IdemKeysRel;

/*
 * What the calls need to know of the extension's objects, looked up once per
 * backend and forgotten when the table's relcache entry is invalidated (DROP
 * and CREATE EXTENSION): the table's owner, as whom every call runs, and
 * its columns, which the direct reads and writes use.
 */
typedef struct IdemKeysCatalog
{
	Oid			namespace;
	IdemKeysRel keys;
	Oid			fence_seq_relid;
	Oid			table_owner;
	Oid			in_progress_label;	/* the enum values of idempotency.state */
	Oid			completed_label;
} IdemKeysCatalog;

extern const IdemKeysCatalog *idem_keys_catalog(void);
extern void idem_keys_rel_describe(Relation rel, IdemKeysRel *out);
extern Datum idem_scope_value(const IdemKeysRel *rel, text *scope);

#endif							/* IDEMPOTENCY_CATALOG_H */
