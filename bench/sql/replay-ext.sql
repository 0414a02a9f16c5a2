-- replay, extension: claim one of the 100k completed keys.
\set key 1000000000000000000 + random(1, 100000)
SELECT outcome, status_code, body FROM idempotency.claim(:key, :fp);
