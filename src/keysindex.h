/*-------------------------------------------------------------------------
 * keysindex.h
 *	  A relation that holds records, open with all its indexes for an
 *	  executor-free write, and the upkeep of those indexes (keysindex.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYSINDEX_H
#define IDEMPOTENCY_KEYSINDEX_H

#include "executor/tuptable.h"
#include "nodes/execnodes.h"
#include "utils/rel.h"

#include "keys.h"

/* The table and all its indexes (as many as it has), open for one write. */
typedef struct IdemWriteRel
{
	Relation	rel;
	int			nindexes;
	Relation   *indexes;
	IndexInfo **info;
	bool	   *arbiter;		/* a key index (keysrel.c), valid or being built */
	bool		only_arbiters;	/* no unique or exclusion index but those */
	bool		direct;			/* the direct write does what the executor would */
} IdemWriteRel;

extern void idem_write_rel_open(IdemCall *call, IdemWriteRel *w);
extern void idem_write_rel_close(IdemWriteRel *w);
extern bool idem_insert_index_entries(IdemWriteRel *w, TupleTableSlot *slot, bool speculative,
									  bool summarizing_only);

#endif							/* IDEMPOTENCY_KEYSINDEX_H */
