/*-------------------------------------------------------------------------
 * keysrel.h
 *	  What a relation that holds records is, for the executor-free reads
 *	  and writes: its columns and its key index (keysrel.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYSREL_H
#define IDEMPOTENCY_KEYSREL_H

#include "access/genam.h"
#include "utils/rel.h"
#include "utils/snapshot.h"

#include "keys.h"

/*
 * How to scan a key index for a (scope, key): for each of the two columns,
 * its position in the index and the index's own equality, operator class
 * input type and collation for it.
 */
typedef struct IdemKeyScan
{
	AttrNumber	indexcol;
	RegProcedure eq;
	Oid			subtype;
	Oid			collation;
	bool		builtin;		/* its equality and order functions are built in */
} IdemKeyScan;

/*
 * The facts of a relation that holds records, decided once per relcache
 * build of it: its column numbers and scope type (as catalog.c described
 * them), the key index that claim's read scans (InvalidOid: none),
 * whether the direct writes may be taken on it (-1: not decided yet), and
 * whether they run only built-in code and the extension's own (keysindex.c).
 */
typedef struct IdemRelFacts
{
	Oid			relid;
	AttrNumber	att[IDEM_NUM_COLS];
	Oid			scope_type;
	Oid			scope_collation;
	Oid			key_index;
	IdemKeyScan key_scan;
	IdemKeyScan scope_scan;
	int			direct;
	bool		direct_own_code;
} IdemRelFacts;

/*
 * The key index of a relation, open, and how to scan it; builtin: a scan of
 * it runs only PostgreSQL's built-in functions (its comparisons, and the
 * relation's table access method).
 */
typedef struct IdemKeyIndex
{
	Relation	index;
	IdemKeyScan key;
	IdemKeyScan scope;
	bool		builtin;
} IdemKeyIndex;

extern IdemRelFacts *idem_rel_facts(const IdemCall *call, Relation rel);
extern bool idem_is_key_index(Relation rel, Relation index, const AttrNumber *att);
extern void idem_require_key_index(const IdemCall *call, const IdemRelFacts *f);
extern void idem_key_index_open(const IdemCall *call, Relation rel, IdemKeyIndex *out);
extern IndexScanDesc idem_key_scan_begin(Relation rel, const IdemKeyIndex *ki,
										 Snapshot snapshot, const IdemCall *call, text *key);

#endif							/* IDEMPOTENCY_KEYSREL_H */
