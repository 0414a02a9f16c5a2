-- proxy, fresh: claim a new key of one of 1024 tenants, then complete it (two
-- autocommit calls), the same script directly on a shard and through the proxy.
-- A key no run has used, as in fresh-ext.sql.
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
\set tenant random(1, 1024)
SELECT outcome, fence FROM idempotency.claim(:key, :fp, 'tenant_' || :tenant) \gset
SELECT idempotency.complete(:key, :fence, 201, :body, NULL, 'tenant_' || :tenant);
