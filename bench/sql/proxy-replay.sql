-- proxy, replay: claim one of the 10k completed keys r1..r10000 (key rN
-- belongs to tenant_<N mod 1024>), directly on a shard and through the proxy.
\set n random(1, 10000)
\set tenant :n % 1024
SELECT outcome, status_code, body FROM idempotency.claim('r' || :n, :fp, 'tenant_' || :tenant);
