-- in_progress, PL/pgSQL function: one of the 100k started keys.
\set key 2000000000000000000 + random(1, 100000)
SELECT outcome FROM plpgsql_claim(:key, :hash);
