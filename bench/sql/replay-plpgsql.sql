-- replay, PL/pgSQL function: claim one of the 100k completed keys.
\set key 1000000000000000000 + random(1, 100000)
SELECT outcome, response_code, response_body FROM plpgsql_claim(:key, :hash);
