-- same transaction, PL/pgSQL functions around the business row.
-- A key no run has used: the run number P, the client and its own counter,
-- spread over 18 digits by a fixed permutation (so, in random order).
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
BEGIN;
SELECT outcome FROM plpgsql_claim(:key, :hash);
INSERT INTO payments (idem_key, amount_cents, currency) VALUES (:key, 1999, 'EUR');
SELECT plpgsql_complete(:key, 201, :body);
COMMIT;
