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
		 * Readies the transaction for {@code complete}: sends what the framework holds back until the
		 * commit (JPA's pending changes), and says whether the COMMIT may travel with {@code complete}
		 * in one round trip: not when something of the framework's must still run inside the
		 * transaction at commit (Spring's before-commit callbacks, {@code @TransactionalEventListener}
		 * of phase BEFORE_COMMIT). Plain JDBC holds nothing back and has nothing to run.
		 *
		 * @return whether {@code complete} may carry the COMMIT
		 * @throws SQLException the error of a write it sends
		 */
		default boolean readyToComplete() throws SQLException {
			return true;
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
