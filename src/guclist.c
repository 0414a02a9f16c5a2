/*-------------------------------------------------------------------------
 * guclist.c
 *	  Settings that hold a list of names: parsed once, by the setting's
 *	  check hook, so that a malformed list fails the SET or the reload
 *	  instead of every later use.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "nodes/pg_list.h"
#include "utils/guc.h"
#include "utils/varlena.h"

#include "compat.h"
#include "guclist.h"

/*
 * Parses value, the new value of setting param, into an IdemNameList made
 * with guc_malloc, for the check hook's *extra.  identifiers: names are SQL
 * identifiers (lower-cased unless quoted, as database names); otherwise
 * they are kept as written.  Returns false, with the error set for the GUC
 * machinery, when the list does not parse.
 */
bool
idem_name_list_parse(const char *value, const char *param, bool identifiers, void **extra)
{
	char	   *raw = pstrdup(value);
	List	   *names = NIL;
	ListCell   *lc;
	Size		size = offsetof(IdemNameList, names);
	IdemNameList *list;
	char	   *out;

	if (!(identifiers ? SplitIdentifierString(raw, ',', &names) :
		  SplitGUCList(raw, ',', &names)))
	{
		GUC_check_errcode(ERRCODE_INVALID_PARAMETER_VALUE);
		GUC_check_errmsg("invalid list syntax in parameter \"%s\"", param);
		GUC_check_errhint("Separate the names with commas; double-quote a name that holds a comma.");
		return false;
	}
	foreach(lc, names)
		size += strlen((char *) lfirst(lc)) + 1;
	list = guc_malloc(LOG, size);
	if (list == NULL)
	{
		GUC_check_errcode(ERRCODE_OUT_OF_MEMORY);
		GUC_check_errmsg("out of memory");
		return false;
	}
	list->count = list_length(names);
	out = list->names;
	foreach(lc, names)
	{
		strcpy(out, (char *) lfirst(lc));
		out += strlen(out) + 1;
	}
	list_free(names);
	pfree(raw);
	*extra = list;
	return true;
}

/* Tells whether name (len bytes) is in the list; any_case: compared case-insensitively. */
bool
idem_name_list_contains(const IdemNameList *list, const char *name, int len, bool any_case)
{
	const char *entry;

	if (list == NULL)
		return false;
	entry = list->names;
	for (int i = 0; i < list->count; i++)
	{
		int			entry_len = strlen(entry);

		if (entry_len == len &&
			(any_case ? pg_strncasecmp(entry, name, len) : strncmp(entry, name, len)) == 0)
			return true;
		entry += entry_len + 1;
	}
	return false;
}
