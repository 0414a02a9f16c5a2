-- mix, extension: production traffic, per 1000 requests 980 with a fresh key
-- (claim, then complete), 15 retries of a completed key (a replay) and 5
-- retries while the first attempt still runs (in_progress).
\set r random(1, 1000)
\set seq :seq + 1
\if :r <= 980
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
SELECT outcome, fence FROM idempotency.claim(:key, :fp) \gset
SELECT idempotency.complete(:key, :fence, 201, :body);
\elif :r <= 995
\set key 1000000000000000000 + random(1, 100000)
SELECT outcome, status_code, body FROM idempotency.claim(:key, :fp);
\else
\set key 2000000000000000000 + random(1, 100000)
SELECT outcome, retry_after FROM idempotency.claim(:key, :fp);
\endif
