-- fresh, extension: claim a new key, then complete it (two autocommit calls).
-- A key no run has used: the run number P, the client and its own counter,
-- spread over 18 digits by a fixed permutation (so, in random order).
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
SELECT outcome, fence FROM idempotency.claim(:key, :fp) \gset
SELECT idempotency.complete(:key, :fence, 201, :body);
