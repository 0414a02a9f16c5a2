/*-------------------------------------------------------------------------
 * guclist.h
 *	  Settings that hold a list of names, parsed once when set (guclist.c).
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_GUCLIST_H
#define IDEMPOTENCY_GUCLIST_H

#include "postgres.h"

/* A parsed list: count names, each NUL-terminated, one after the other. */
typedef struct IdemNameList
{
	int			count;
	char		names[FLEXIBLE_ARRAY_MEMBER];
} IdemNameList;

extern bool idem_name_list_parse(const char *value, const char *param, bool identifiers,
								 void **extra);
extern bool idem_name_list_contains(const IdemNameList *list, const char *name, int len,
									bool any_case);

#endif							/* IDEMPOTENCY_GUCLIST_H */
