-- fresh, PL/pgSQL functions: claim a new key, then complete it.
-- A key no run has used: the run number P, the client and its own counter,
-- spread over 18 digits by a fixed permutation (so, in random order).
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
SELECT outcome FROM plpgsql_claim(:key, :hash);
SELECT plpgsql_complete(:key, 201, :body);
