package io.github.idempotency.servlet;

import java.sql.Connection;
import java.sql.SQLException;

/**
 * Where the filter opens the handler's transaction: plain JDBC ({@link JdbcRequestTransactions}), or a
 * framework's transaction manager (the Spring Boot auto-configuration binds it to the request's thread,
 * so that JdbcTemplate, JPA and {@code @Transactional} join it).
 */
public interface RequestTransactions {

	/**
	 * Begins the handler's transaction, on a connection of its own (never the claim's).
	 *
	 * @return the transaction
	 * @throws SQLException when it cannot begin (no connection)
	 */
	RequestTransaction begin() throws SQLException;

	/** The handler's transaction. */
	interface RequestTransaction {
		/**
		 * The transaction's connection, where {@code complete} runs.
		 *
		 * @return the connection
		 * @throws SQLException when it cannot be had
		 */
		Connection connection() throws SQLException;

		/**
		 * Sends what the framework holds back until the commit (JPA's pending changes) to the
		 * connection, before {@code complete} and the COMMIT go together. Plain JDBC holds nothing.
		 *
		 * @throws SQLException the error of a write it sends
		 */
		default void flush() throws SQLException {
		}

		/**
		 * Commits (nothing to send when {@code complete} carried the COMMIT) and gives the connection
		 * back.
		 *
		 * @throws Exception the error of the COMMIT (a {@link SQLException}, or the framework's exception
		 *     with one as its cause)
		 */
		void commit() throws Exception;

		/** Rolls back, unless it has ended, and gives the connection back; never throws. */
		void rollback();
	}
}
