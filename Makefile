# idempotency: PGXS build of the extension and its three kinds of tests.
# Development and CI builds add -Werror: make COPT=-Werror (scripts/test does).

MODULE_big = idempotency
OBJS = \
	args.o \
	citus.o \
	claim.o \
	fingerprint.o \
	guclist.o \
	headers.o \
	idempotency.o \
	keys.o \
	keysheap.o \
	reaper.o \
	record.o \
	shard.o \
	stats.o \
	wait.o
PGFILEDESC = "idempotency - idempotency keys for HTTP APIs"

EXTENSION = idempotency idempotency_proxy
DATA = idempotency--1.0.sql
DATA += idempotency--1.0--1.1.sql idempotency_proxy--1.1.sql

PG_CPPFLAGS = -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
SHLIB_LINK = -lcrypto

# Every test runs against a server that has the library preloaded.
REGRESS = $(basename $(notdir $(sort $(wildcard sql/*.sql))))
REGRESS_OPTS = --temp-instance=tmp_check_regress --temp-config=test/preload.conf
ISOLATION = $(basename $(notdir $(sort $(wildcard specs/*.spec))))
ISOLATION_OPTS = --temp-instance=tmp_check_isolation --temp-config=test/preload.conf
TAP_TESTS := $(if $(wildcard t/*.pl),1,)

EXTRA_CLEAN = tmp_check_regress tmp_check_isolation output_iso

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)
