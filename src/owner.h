/*-------------------------------------------------------------------------
 * owner.h
 *	  The security boundary: who may call the API, and the switch to the
 *	  table's owner for the duration of a call (owner.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_OWNER_H
#define IDEMPOTENCY_OWNER_H

#include "postgres.h"

/* What idem_owner_enter changed, for idem_owner_leave to restore. */
typedef struct IdemOwnerSave
{
	Oid			userid;
	int			sec_context;
	int			guc_nestlevel;	/* 0 while the search_path is not yet restricted */
} IdemOwnerSave;

extern void idem_owner_check_caller(Oid nsp, Oid caller);
extern void idem_owner_become(Oid table_owner, IdemOwnerSave *save);
extern void idem_owner_restrict_path(IdemOwnerSave *save);
extern void idem_owner_enter(Oid table_owner, IdemOwnerSave *save);
extern void idem_owner_leave(const IdemOwnerSave *save);

#endif							/* IDEMPOTENCY_OWNER_H */
