#!/usr/bin/env python3
"""Summarises `perf script -F comm,tid,ip,sym` output of PostgreSQL backends.

Prints where the backends' CPU samples went (the extension's functions, the
statements, commit, the client connection), then, for each API function
found, the functions beneath it by inclusive share and by self share.
Used by bench/profile; reads the perf script text on stdin.
"""
import collections
import sys

# The functions whose cost is broken down: the extension's API, and the
# PL/pgSQL baseline's call handler.
API = ("idempotency_claim", "idempotency_complete", "plpgsql_call_handler")

# Outside the API, the first of these met from the root names the bucket.
BUCKETS = (
    ("CommitTransactionCommand", "commit"),
    ("StartTransactionCommand", "start transaction"),
    ("exec_parse_message", "parse"),
    ("exec_bind_message", "bind and plan"),
    ("PortalStart", "executor start (statement)"),
    ("standard_ExecutorRun", "executor run (statement)"),
    ("PortalRun", "executor (statement)"),
    ("pq_getbyte", "reading from the client"),
    ("pq_getmessage", "reading from the client"),
    ("secure_read", "reading from the client"),
    ("pq_flush", "sending to the client"),
    ("socket_flush", "sending to the client"),
    ("secure_write", "sending to the client"),
    ("EndCommand", "sending to the client"),
)


def samples(stream):
    """Yields (comm, frames) per sample, frames from leaf to root."""
    comm = None
    frames = []
    for line in stream:
        if not line.strip():
            if comm is not None:
                yield comm, frames
            comm, frames = None, []
        elif line[0] not in " \t":
            comm, frames = line.split()[0], []
        else:
            parts = line.split(None, 1)
            name = parts[1].strip() if len(parts) > 1 else "[unknown]"
            name = name.replace(" (inlined)", "")
            frames.append(name)
    if comm is not None:
        yield comm, frames


def pct(n, total):
    return 100.0 * n / total if total else 0.0


def main():
    total = 0
    buckets = collections.Counter()
    inclusive = {api: collections.Counter() for api in API}
    selfcost = {api: collections.Counter() for api in API}
    in_api = collections.Counter()

    for comm, frames in samples(sys.stdin):
        if comm != "postgres" or not frames:
            continue
        total += 1
        rooted = list(reversed(frames))
        api = next((f for f in rooted if f in API), None)
        if api:
            in_api[api] += 1
            buckets["API: " + api] += 1
            below = rooted[rooted.index(api) + 1:]
            for f in set(below):
                inclusive[api][f] += 1
            selfcost[api][frames[0] if below else api] += 1
            continue
        names = set(rooted)
        label = next((b for f, b in BUCKETS if f in names), "other (kernel, idle, unwinding)")
        buckets[label] += 1

    print(f"{total} samples of postgres backends (on-CPU)")
    print()
    print("| where | share of backend CPU |")
    print("| --- | ---: |")
    for label, n in buckets.most_common():
        print(f"| {label} | {pct(n, total):.1f}% |")
    for api in API:
        n = in_api[api]
        if not n:
            continue
        print()
        print(f"### {api}: {pct(n, total):.1f}% of backend CPU ({n} samples)")
        print()
        print("Beneath it, inclusive (share of its own samples):")
        print()
        print("| function | inclusive |")
        print("| --- | ---: |")
        for f, c in inclusive[api].most_common(30):
            if f != "[unknown]":
                print(f"| {f} | {pct(c, n):.1f}% |")
        print()
        print("Self (leaf functions):")
        print()
        print("| function | self |")
        print("| --- | ---: |")
        for f, c in selfcost[api].most_common(15):
            print(f"| {f} | {pct(c, n):.1f}% |")


if __name__ == "__main__":
    main()
