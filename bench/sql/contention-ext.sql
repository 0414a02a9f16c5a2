-- contention, extension: at any moment every client claims one of 10 keys;
-- the winner completes it.  The 10 keys change every 50 ms (the key holds
-- the current 50 ms window), so keys are won again and again while the
-- others read or wait on them: new, replay and in_progress answers all
-- occur under row-lock contention.  The lease (5 s) is far longer than a
-- winner takes, so no winner loses its claim on a loaded machine (its
-- complete would fail, and pgbench would stop that client).
\set slot random(1, 10)
SELECT k.key, (c.outcome = 'new')::int AS won, coalesce(c.fence, 0) AS fence
	FROM (SELECT :P || '-' || :slot || '-'
				 || floor(extract(epoch FROM clock_timestamp()) * 20)::bigint AS key) k,
		 LATERAL idempotency.claim(k.key, :fp, lease => '5 seconds',
								   retention => '5 seconds') c \gset
\if :won
SELECT idempotency.complete(:key, :fence, 201, :body);
\endif
