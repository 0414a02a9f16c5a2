# idempotency: PGXS build of the extension and its three kinds of tests.
# Development and CI builds add -Werror: make COPT=-Werror (scripts/test does).

MODULE_big = idempotency
OBJS = \
	src/args.o \
	src/catalog.o \
	src/citus.o \
	src/claim.o \
	src/fence.o \
	src/fingerprint.o \
	src/gauges.o \
	src/guclist.o \
	src/headers.o \
	src/idempotency.o \
	src/keys.o \
	src/keysindex.o \
	src/keysread.o \
	src/keysrel.o \
	src/keyswrite.o \
	src/owner.o \
	src/reaper.o \
	src/record.o \
	src/shard.o \
	src/stats.o \
	src/wait.o
PGFILEDESC = "idempotency - idempotency keys for HTTP APIs"

EXTENSION = idempotency idempotency_proxy
DATA = sql/idempotency--1.0.sql sql/idempotency--1.6.sql
DATA += sql/idempotency--1.0--1.1.sql sql/idempotency--1.1--1.2.sql sql/idempotency--1.2--1.3.sql \
	sql/idempotency--1.3--1.4.sql sql/idempotency--1.4--1.5.sql sql/idempotency--1.5--1.6.sql
DATA += sql/idempotency_proxy--1.1.sql sql/idempotency_proxy--1.2.sql sql/idempotency_proxy--1.1--1.2.sql

PG_CPPFLAGS = -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
SHLIB_LINK = -lcrypto

# Every test runs against a server that has the library preloaded: by
# default one that pg_regress starts for itself; with USE_RUNNING_SERVER=1,
# the running server that PGHOST/PGPORT name (as PGXS's installcheck does),
# which must preload it (shared_preload_libraries = 'idempotency').
REGRESS = $(basename $(notdir $(sort $(wildcard test/sql/*.sql))))
ISOLATION = $(basename $(notdir $(sort $(wildcard test/specs/*.spec))))
ifdef USE_RUNNING_SERVER
REGRESS_OPTS = --inputdir=test
ISOLATION_OPTS = --inputdir=test
else
REGRESS_OPTS = --inputdir=test --temp-instance=tmp_check_regress --temp-config=test/preload.conf
ISOLATION_OPTS = --inputdir=test --temp-instance=tmp_check_isolation --temp-config=test/preload.conf
endif
# TAP tests start servers of their own: not against a running server.
TAP_TESTS := $(if $(USE_RUNNING_SERVER),,$(if $(wildcard test/t/*.pl),1,))
PROVE_TESTS ?= test/t/*.pl

EXTRA_CLEAN = tmp_check_regress tmp_check_isolation output_iso

PG_CONFIG ?= pg_config
# indexes_amcheck needs amcheck, which a PostgreSQL built without its contrib
# modules lacks (CI's PostgreSQL 16, a relocatable build from PyPI).
ifeq (,$(wildcard $(shell $(PG_CONFIG) --sharedir)/extension/amcheck.control))
REGRESS := $(filter-out indexes_amcheck,$(REGRESS))
endif
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# PGXS tracks no header dependencies (PostgreSQL's packages are built
# without --enable-depend): every object depends on every header, so that a
# changed struct never links with objects built against its old layout.
$(OBJS): $(wildcard src/*.h)
