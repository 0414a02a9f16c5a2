/*-------------------------------------------------------------------------
 * reaper.c
 *	  The background reaper: not yet written; registers nothing.
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "idempotency.h"

/* Registers the background reaper (nothing yet). */
void
reaper_register(void)
{
}
