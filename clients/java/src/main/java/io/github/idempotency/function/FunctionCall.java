package io.github.idempotency.function;

import io.github.idempotency.ClaimLostException;
import io.github.idempotency.ClaimRequest;
import io.github.idempotency.ClaimResult;
import io.github.idempotency.Flow;
import io.github.idempotency.Idempotency;
import io.github.idempotency.servlet.RequestTransactions;
import io.github.idempotency.servlet.RequestTransactions.RequestTransaction;
import java.lang.System.Logger.Level;
import java.sql.Connection;
import java.sql.SQLException;
import javax.sql.DataSource;

/** One call of an idempotent function: claim, run, complete or release, and lost answers. */
final class FunctionCall<T> {
	private static final System.Logger LOG = System.getLogger(FunctionCall.class.getName());
	/** The status of a stored result and of a stored final error. */
	private static final int RESULT = 200;
	private static final int FAILURE = 400;

	private final DataSource dataSource;
	private final RequestTransactions transactions;
	private final ClaimRequest claim;
	private final FunctionOptions<T> options;
	private final Work<T> work;

	FunctionCall(DataSource dataSource, RequestTransactions transactions, ClaimRequest claim,
			FunctionOptions<T> options, Work<T> work) {
		this.dataSource = dataSource;
		this.transactions = transactions;
		this.claim = claim;
		this.options = options;
		this.work = work;
	}

	/** A claim's answer and, with one transaction, the transaction it is in (open). */
	private record Claimed(ClaimResult result, RequestTransaction tx) {
		void end() {
			if (tx != null) {
				tx.rollback();
			}
		}
	}

	/** What a run gave: its value, and the error that lost the COMMIT's answer (null: committed). */
	private record Ran<T>(T value, byte[] body, Exception lost) {
	}

	/** Claims, runs the work when the claim is new, and answers. */
	T run() throws Exception {
		Claimed got = claim();
		for (int runs = 1; ; runs++) {
			if (!(got.result() instanceof ClaimResult.New ticket)) {
				got.end();
				return answer(got.result());
			}
			Ran<T> ran = runOnce(ticket, got.tx());
			if (ran.lost() == null) {
				return ran.value();
			}
			got = askAfterLostCommit(ran);
			switch (Flow.afterLostCommit(got.result(), RESULT, ran.body(), runs)) {
				case COMMITTED -> {
					got.end();
					return ran.value();
				}
				case OTHER -> {
					got.end();
					return settled(got.result(), ran);
				}
				case GIVE_UP -> {
					got.end();
					release((ClaimResult.New) got.result());
					throw new SQLException("idempotency: the connection was lost at every COMMIT; nothing was kept",
							"08006", ran.lost());
				}
				case RUN_AGAIN -> {
					// below
				}
			}
			LOG.log(Level.WARNING, "idempotency: the function's transaction was lost before it committed; running it again");
		}
	}

	/** Claims, asking again when the answer was lost; with one transaction, in a new transaction left open. */
	private Claimed claim() throws SQLException {
		return Flow.askingAgain(options.claimTries(), options.retryDelay(), again -> {
			if (!options.oneTransaction()) {
				return new Claimed(Idempotency.claim(dataSource, claim, options.tracer()), null);
			}
			RequestTransaction tx = transactions.begin();
			try {
				return new Claimed(Idempotency.claim(tx.connection(), claim, options.tracer()), tx);
			} catch (SQLException | RuntimeException e) {
				tx.rollback();
				throw e;
			}
		});
	}

	/** The result a claim that did not win gives: the stored one, or the exception it says. */
	@SuppressWarnings("unchecked")
	private T answer(ClaimResult result) {
		if (result instanceof ClaimResult.Replay replay) {
			if (replay.statusCode() == FAILURE) {
				throw ResultJson.storedError(claim.key(), replay.body());
			}
			return (T) ResultJson.read(replay.body(), options.resultType());
		}
		if (result instanceof ClaimResult.InProgress busy) {
			throw new IdempotentCallException.InProgress(claim.key(), busy.retryAfter());
		}
		throw new IdempotentCallException.Mismatch(claim.key());
	}

	/** After a lost COMMIT, an answer other than ours: a duplicate's result, or the exception it says. */
	private T settled(ClaimResult result, Ran<T> ran) throws SQLException {
		if (result instanceof ClaimResult.InProgress) {
			throw new ClaimLostException("complete", sqlCause(ran.lost()));
		}
		return answer(result);
	}

	/** The COMMIT's answer was lost: claims again with the token to learn whether it committed. */
	private Claimed askAfterLostCommit(Ran<T> ran) throws SQLException {
		try {
			return claim();
		} catch (SQLException e) {
			SQLException unknown = new SQLException("idempotency: the COMMIT's answer was lost and the database "
					+ "cannot tell whether it took effect; call again with the same arguments", "08006", ran.lost());
			unknown.setNextException(e);
			throw unknown;
		}
	}

	/**
	 * Runs the work once in the claim's transaction (one transaction) or a new one, and ends it: complete
	 * and COMMIT; on an error, ROLLBACK and release (or store a final error).
	 */
	@SuppressWarnings("try") // the lease keeper is only closed
	private Ran<T> runOnce(ClaimResult.New ticket, RequestTransaction claimed) throws Exception {
		RequestTransaction tx;
		try {
			tx = claimed != null ? claimed : transactions.begin();
		} catch (SQLException | RuntimeException e) {
			release(ticket);
			throw e;
		}
		T value;
		byte[] body;
		IdempotentRun outer = IdempotentFunction.current();
		try (LeaseKeeper ignored = options.oneTransaction() ? null : LeaseKeeper.start(dataSource, ticket, options)) {
			IdempotentFunction.setCurrent(new IdempotentRun(ticket, () -> checkpointConnection(tx),
					options.oneTransaction()));
			value = work.run(tx.connection());
			body = ResultJson.write(value);
		} catch (Exception | Error e) {
			tx.rollback();
			failed(ticket, e);
			throw e;
		} finally {
			IdempotentFunction.setCurrent(outer); // a function called inside another gives the outer run back
		}
		return complete(ticket, tx, value, body);
	}

	/** Stores the result with the work's writes and commits. */
	private Ran<T> complete(ClaimResult.New ticket, RequestTransaction tx, T value, byte[] body) throws Exception {
		try {
			if (tx.readyToComplete()) {
				ticket.completeAndCommit(tx.connection(), RESULT, body, null);
			} else {
				ticket.complete(tx.connection(), RESULT, body, null);
			}
			tx.commit();
			return new Ran<>(value, body, null);
		} catch (ClaimLostException e) {
			tx.rollback();
			throw e;
		} catch (Exception e) {
			tx.rollback();
			if (Flow.isLost(e)) {
				return new Ran<>(value, body, e);
			}
			release(ticket);
			throw e;
		}
	}

	/**
	 * Ends the claim of a run that failed with e (its writes rolled back): stores a final error so that
	 * duplicates get it back, else frees the key (one transaction: it rolled back with the claim).
	 */
	private void failed(ClaimResult.New ticket, Throwable e) {
		boolean keep;
		try {
			keep = options.isFinal(e);
		} catch (RuntimeException t) {
			LOG.log(Level.WARNING, "idempotency: the finalErrors test failed: " + t);
			keep = false;
		}
		if (!keep) {
			release(ticket);
			return;
		}
		try (Connection db = dataSource.getConnection()) {
			db.setAutoCommit(true);
			if (options.oneTransaction()) {
				Idempotency.claimAndComplete(db, claim, FAILURE, ResultJson.error(e), null, options.tracer());
			} else {
				ticket.complete(db, FAILURE, ResultJson.error(e), null);
			}
		} catch (ClaimLostException lost) {
			// another run owns the key: nothing of ours to keep
		} catch (SQLException | RuntimeException x) {
			LOG.log(Level.WARNING, "idempotency: could not keep the function's final error: " + x);
			release(ticket);
		}
	}

	/** Two transactions: frees the key so that a retry runs again (one transaction: rolled back already). */
	private void release(ClaimResult.New ticket) {
		if (!options.oneTransaction()) {
			Flow.release(dataSource, ticket);
		}
	}

	/** Where a checkpoint runs: the work's transaction (one transaction), or a connection of its own. */
	private Connection checkpointConnection(RequestTransaction tx) {
		try {
			return options.oneTransaction() ? tx.connection() : dataSource.getConnection();
		} catch (SQLException e) {
			throw new IllegalStateException("idempotency: no connection for the checkpoint", e);
		}
	}

	/** The first SQLException of e's chain, or one that says the answer was lost. */
	private static SQLException sqlCause(Throwable e) {
		for (Throwable t = e; t != null; t = t.getCause()) {
			if (t instanceof SQLException sql) {
				return sql;
			}
		}
		return new SQLException("the connection was lost", "08006", e);
	}
}
