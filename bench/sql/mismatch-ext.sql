-- mismatch, extension: a completed key with another request's fingerprint.
\set key 1000000000000000000 + random(1, 100000)
SELECT outcome, created_at FROM idempotency.claim(:key, :fp2);
