-- contention, extension: every client claims one of 10 keys; the winner
-- completes it.  A retention of 1 ms makes a completed record expire at once,
-- so the keys are won again and again while the others read or wait on them:
-- new, replay and in_progress answers all occur under row-lock contention.
\set key permute(:P * 1000000000000 + 999000000000 + random(1, 10), 1000000000000000000, 42)
SELECT (outcome = 'new')::int AS won, coalesce(fence, 0) AS fence
	FROM idempotency.claim(:key, :fp, retention => '1 millisecond') \gset
\if :won
SELECT idempotency.complete(:key, :fence, 201, :body);
\endif
