package io.github.idempotency.function;

import java.sql.Connection;

/**
 * The work an idempotent function runs once.
 *
 * @param <T> its result, stored as JSON and given back to duplicates
 */
@FunctionalInterface
public interface Work<T> {
	/**
	 * Does the work.
	 *
	 * @param tx the transaction its writes go through; its result is stored in it (one transaction) or
	 *     beside it (two). Do not commit, roll back or close it.
	 * @return the result
	 * @throws Exception a failure: the writes roll back, and the key is released unless the error is
	 *     final ({@link FunctionOptions#finalErrors})
	 */
	T run(Connection tx) throws Exception;
}
