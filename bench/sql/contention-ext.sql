-- contention, extension: every client claims one of 10 keys; the winner
-- completes it.  A retention of 50 ms (and a lease as long: a retention may
-- not be shorter) makes a completed record expire almost at once, so the
-- keys are won again and again while the others read or wait on them: new,
-- replay and in_progress answers all occur under row-lock contention.
\set key permute(:P * 1000000000000 + 999000000000 + random(1, 10), 1000000000000000000, 42)
SELECT (outcome = 'new')::int AS won, coalesce(fence, 0) AS fence
	FROM idempotency.claim(:key, :fp, lease => '50 milliseconds',
	                       retention => '50 milliseconds') \gset
\if :won
SELECT idempotency.complete(:key, :fence, 201, :body);
\endif
