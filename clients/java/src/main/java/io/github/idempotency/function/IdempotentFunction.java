package io.github.idempotency.function;

import io.github.idempotency.ClaimRequest;
import io.github.idempotency.Idempotency;
import io.github.idempotency.servlet.JdbcRequestTransactions;
import io.github.idempotency.servlet.RequestTransactions;
import javax.sql.DataSource;

/**
 * Runs a unit of work once per key, as the servlet filter runs a request once: the same claim, complete,
 * token and round trips ({@link io.github.idempotency.Flow}). The work gets a transaction whose writes
 * commit with its stored result; a duplicate gets that result back (deserialized to the result's type)
 * without running; a duplicate that arrives while it runs waits, then gets
 * {@link IdempotentCallException.InProgress}; an error releases the key unless it is final (stored, and
 * given back as {@link IdempotentCallException.Stored}); other arguments under the same key are
 * {@link IdempotentCallException.Mismatch}.
 *
 * <pre>{@code
 * Charge c = IdempotentFunction.run(dataSource, "order-42", FunctionOptions.of(Charge.class).args(42, 1000),
 *         tx -> charge(tx, 42, 1000));
 * }</pre>
 */
public final class IdempotentFunction {
	private static final ThreadLocal<IdempotentRun> CURRENT = new ThreadLocal<>();

	private IdempotentFunction() {
	}

	/**
	 * Runs work once for key, on connections of dataSource (plain JDBC).
	 *
	 * @param <T> the result's type
	 * @param dataSource the pool
	 * @param key the unit of work's key, 1 to 255 bytes
	 * @param options the options
	 * @param work the work
	 * @return its result, this run's or the stored one
	 * @throws Exception the work's error; an {@link IdempotentCallException}; a
	 *     {@link java.sql.SQLException} of the store ({@link io.github.idempotency.ClaimLostException}
	 *     when another run took the key over)
	 */
	public static <T> T run(DataSource dataSource, String key, FunctionOptions<T> options, Work<T> work)
			throws Exception {
		return run(dataSource, new JdbcRequestTransactions(dataSource), key, options, work);
	}

	/**
	 * Runs work once for key, in transactions of {@code transactions} (Spring's: the work's
	 * JdbcTemplate and JPA writes join it).
	 *
	 * @param <T> the result's type
	 * @param dataSource the pool the claims run on
	 * @param transactions where the work's transaction comes from
	 * @param key the unit of work's key
	 * @param options the options
	 * @param work the work
	 * @return its result, this run's or the stored one
	 * @throws Exception as {@link #run(DataSource, String, FunctionOptions, Work)}
	 */
	public static <T> T run(DataSource dataSource, RequestTransactions transactions, String key,
			FunctionOptions<T> options, Work<T> work) throws Exception {
		ClaimRequest claim = new ClaimRequest(options.scope(), key, ResultJson.fingerprint(options.args()),
				options.lease(), options.retention(), options.waitFor(), Idempotency.newToken());
		return new FunctionCall<>(dataSource, transactions, claim, options, work).run();
	}

	/**
	 * The run in progress on this thread: inside the work, its attempt, recovery point and
	 * {@link IdempotentRun#checkpoint}.
	 *
	 * @return the run; null outside an idempotent function
	 */
	public static IdempotentRun current() {
		return CURRENT.get();
	}

	/** Makes run the current one (null: none). */
	static void setCurrent(IdempotentRun run) {
		if (run == null) {
			CURRENT.remove();
		} else {
			CURRENT.set(run);
		}
	}
}
