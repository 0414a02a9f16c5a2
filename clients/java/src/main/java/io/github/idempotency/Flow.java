package io.github.idempotency;

import java.lang.System.Logger.Level;
import java.sql.Connection;
import java.sql.SQLException;
import java.sql.SQLTransientConnectionException;
import java.time.Duration;
import javax.sql.DataSource;

/**
 * The steps the servlet filter and the idempotent function share, so that a fix lands once: claiming
 * again with the same token when an answer was lost, telling a lost answer from a refusal, and freeing
 * a key whose work failed. Applications use the filter or the function; this is their common ground.
 */
public final class Flow {
	private static final System.Logger LOG = System.getLogger(Flow.class.getName());

	/** How many times work may run when each COMMIT's answer is lost and it rolled back. */
	public static final int MAX_RUNS = 3;

	private Flow() {
	}

	/** What the claim asked again after a lost COMMIT answer says. */
	public enum AfterLostCommit {
		/** The work's COMMIT went through: send (return) its own answer. */
		COMMITTED,
		/** It rolled back and this claim won again: run the work again. */
		RUN_AGAIN,
		/** It rolled back, and the work has run {@link #MAX_RUNS} times: give up (release the new claim). */
		GIVE_UP,
		/** Another answer: a duplicate's replay (it won after ours rolled back), in progress or mismatch. */
		OTHER
	}

	/**
	 * Reads the answer of the claim asked again (with the same token) after the answer to the work's
	 * COMMIT was lost: a replay of exactly what the work stored means it committed.
	 *
	 * @param again the claim's answer
	 * @param status the status the work stored
	 * @param body the body the work stored
	 * @param runs how many times the work has run
	 * @return what to do
	 */
	public static AfterLostCommit afterLostCommit(ClaimResult again, int status, byte[] body, int runs) {
		if (again instanceof ClaimResult.Replay replay && replay.statusCode() == status
				&& java.util.Arrays.equals(replay.body(), body)) {
			return AfterLostCommit.COMMITTED;
		}
		if (!(again instanceof ClaimResult.New)) {
			return AfterLostCommit.OTHER;
		}
		return runs >= MAX_RUNS ? AfterLostCommit.GIVE_UP : AfterLostCommit.RUN_AGAIN;
	}

	/**
	 * One try of a claim: it cleans up after itself (rolls back the transaction it opened) before it
	 * throws.
	 *
	 * @param <T> what it returns
	 */
	@FunctionalInterface
	public interface Attempt<T> {
		/**
		 * Tries once.
		 *
		 * @param again whether an earlier try's answer was lost
		 * @return its answer
		 * @throws SQLException its error
		 */
		T run(boolean again) throws SQLException;
	}

	/**
	 * Runs attempt, asking again with backoff (retryDelay, doubled each time) while its answer is lost
	 * (the connection failed, or none could be made), up to tries times in all. The claim carries a
	 * token, so a claim that did commit answers {@code new} again with the same fence. A pool that timed
	 * out waiting for a connection is not asked again: it has waited already.
	 *
	 * @param <T> the answer's type
	 * @param tries how many tries in all, at least 1
	 * @param retryDelay the wait before the second try
	 * @param attempt the try
	 * @return the first answer given
	 * @throws SQLException an error that is an answer, or the last lost one
	 */
	public static <T> T askingAgain(int tries, Duration retryDelay, Attempt<T> attempt) throws SQLException {
		long wait = retryDelay.toMillis();
		for (int n = 1; ; n++) {
			try {
				return attempt.run(n > 1);
			} catch (SQLException e) {
				if (!Idempotency.isConnectionLost(e) || n >= tries || e instanceof SQLTransientConnectionException) {
					throw e;
				}
				LOG.log(Level.WARNING, "idempotency: claim " + n + " of " + tries + " got no answer, asking again: " + e);
			}
			sleep(wait);
			wait *= 2;
		}
	}

	/**
	 * Whether e, or the first SQLException among its causes, says the connection was lost (the answer,
	 * not a refusal).
	 *
	 * @param e the error
	 * @return true when the answer was lost
	 */
	public static boolean isLost(Throwable e) {
		for (Throwable t = e; t != null; t = t.getCause()) {
			if (t instanceof SQLException sql) {
				return Idempotency.isConnectionLost(sql);
			}
		}
		return false;
	}

	/**
	 * Frees the key of ticket (if any) on a connection of ds of its own, so that a retry runs again; a
	 * failure only delays that retry until the lease ends, so it is logged, not thrown.
	 *
	 * @param ds the pool
	 * @param ticket the claim, null for none
	 */
	public static void release(DataSource ds, ClaimResult.New ticket) {
		if (ticket == null) {
			return;
		}
		try (Connection db = ds.getConnection()) {
			db.setAutoCommit(true);
			ticket.release(db);
		} catch (SQLException | RuntimeException e) {
			LOG.log(Level.WARNING, "idempotency: release: " + e);
		}
	}

	/**
	 * Sleeps ms milliseconds, keeping an interrupt.
	 *
	 * @param ms how long
	 */
	public static void sleep(long ms) {
		try {
			Thread.sleep(ms);
		} catch (InterruptedException e) {
			Thread.currentThread().interrupt();
		}
	}
}
