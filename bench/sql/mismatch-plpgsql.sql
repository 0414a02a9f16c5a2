-- mismatch, PL/pgSQL function: a completed key with another request's hash.
\set key 1000000000000000000 + random(1, 100000)
SELECT outcome FROM plpgsql_claim(:key, :hash2);
