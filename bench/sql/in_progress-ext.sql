-- in_progress, extension: one of the 100k keys whose lease lasts a day.
\set key 2000000000000000000 + random(1, 100000)
SELECT outcome, retry_after FROM idempotency.claim(:key, :fp);
