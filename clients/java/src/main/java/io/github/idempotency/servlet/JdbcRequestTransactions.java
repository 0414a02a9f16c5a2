package io.github.idempotency.servlet;

import io.github.idempotency.TransactionCommands;
import java.sql.Connection;
import java.sql.SQLException;
import javax.sql.DataSource;

/**
 * The handler's transaction on a connection of a {@link DataSource} with autocommit off; the handler
 * gets it with {@link IdempotencyFilter#connection}.
 */
public final class JdbcRequestTransactions implements RequestTransactions {
	private final DataSource dataSource;

	/**
	 * Transactions on connections of {@code dataSource}.
	 *
	 * @param dataSource the pool
	 */
	public JdbcRequestTransactions(DataSource dataSource) {
		this.dataSource = dataSource;
	}

	@Override
	public RequestTransaction begin() throws SQLException {
		Connection c = dataSource.getConnection();
		try {
			c.setAutoCommit(false);
		} catch (SQLException e) {
			c.close();
			throw e;
		}
		return new RequestTransaction() {
			private boolean ended;

			@Override
			public Connection connection() {
				return c;
			}

			@Override
			public void commit() throws SQLException {
				ended = true;
				try {
					TransactionCommands.commit(c);
				} finally {
					giveBack(c);
				}
			}

			@Override
			public void rollback() {
				if (ended) {
					return;
				}
				ended = true;
				try {
					TransactionCommands.rollback(c);
				} catch (SQLException ignored) {
					// a lost connection rolls back by itself
				} finally {
					giveBack(c);
				}
			}
		};
	}

	/** Gives c back to the pool in autocommit, as it came. */
	private static void giveBack(Connection c) {
		try {
			try {
				if (!c.isClosed()) {
					c.setAutoCommit(true);
				}
			} finally {
				c.close();
			}
		} catch (SQLException ignored) {
			// closed anyway: the pool discards a broken connection
		}
	}
}
