package io.github.idempotency;

import java.sql.Connection;
import java.sql.SQLException;
import org.postgresql.PGConnection;

/**
 * COMMIT and ROLLBACK through a transaction pooler. pgjdbc sends a connection's COMMIT and ROLLBACK as
 * named server-side statements unless the connection's {@code prepareThreshold} is 0, and pgbouncer
 * before 1.21 in transaction pooling runs the next transaction on any server connection, where that
 * name does not exist (26000) or is another client's (42P05). The filter commits and rolls back through
 * these, so that it works behind such a pooler with pgjdbc's defaults; the connection's own setting
 * stays as the application made it for every other statement.
 */
public final class TransactionCommands {
	private TransactionCommands() {
	}

	/**
	 * Commits c with an unnamed statement.
	 *
	 * @param c the connection, autocommit off
	 * @throws SQLException the COMMIT's error
	 */
	public static void commit(Connection c) throws SQLException {
		int saved = unnamed(c);
		try {
			c.commit();
		} finally {
			restore(c, saved);
		}
	}

	/**
	 * Rolls c back with an unnamed statement.
	 *
	 * @param c the connection, autocommit off
	 * @throws SQLException the ROLLBACK's error
	 */
	public static void rollback(Connection c) throws SQLException {
		int saved = unnamed(c);
		try {
			c.rollback();
		} finally {
			restore(c, saved);
		}
	}

	/**
	 * Makes c's transaction commands unnamed until {@link #restore}.
	 *
	 * @param c the connection
	 * @return what to give {@link #restore}: the connection's prepareThreshold, or -1 when it is not
	 *     pgjdbc's or is closed
	 */
	public static int unnamed(Connection c) {
		try {
			if (c.isWrapperFor(PGConnection.class)) {
				PGConnection pg = c.unwrap(PGConnection.class);
				int saved = pg.getPrepareThreshold();
				pg.setPrepareThreshold(0);
				return saved;
			}
		} catch (SQLException e) {
			// closed: nothing to send, nothing to restore
		}
		return -1;
	}

	/**
	 * Gives c back the prepareThreshold that {@link #unnamed} saved.
	 *
	 * @param c the connection
	 * @param saved what {@link #unnamed} returned
	 */
	public static void restore(Connection c, int saved) {
		if (saved < 0) {
			return;
		}
		try {
			c.unwrap(PGConnection.class).setPrepareThreshold(saved);
		} catch (SQLException e) {
			// closed: the pool discards it
		}
	}
}
