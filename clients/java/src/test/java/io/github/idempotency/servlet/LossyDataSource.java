package io.github.idempotency.servlet;

import java.io.PrintWriter;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Proxy;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.SQLException;
import java.sql.SQLFeatureNotSupportedException;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.logging.Logger;
import javax.sql.DataSource;

/**
 * A DataSource in front of a real one that loses answers on purpose, as a network does: the statement
 * or the COMMIT runs on the server, then the connection is aborted and the caller gets a connection
 * error (08006) instead of the answer. Or a statement fails as the server would refuse it.
 */
public final class LossyDataSource implements DataSource {
	private final DataSource real;
	/** How many of the next claims lose their answer. */
	public final AtomicInteger loseClaims = new AtomicInteger();
	/** How many of the next COMMITs (a connection's, or sent with complete) commit and lose their answer. */
	public final AtomicInteger loseCommitsAfter = new AtomicInteger();
	/** How many of the next COMMITs roll back and lose their answer. */
	public final AtomicInteger loseCommitsBefore = new AtomicInteger();
	/** How many of the next completes run and lose their answer. */
	public final AtomicInteger loseCompletes = new AtomicInteger();
	/** How many claims lose their answer after a COMMIT whose answer was lost (armed at that COMMIT). */
	public final AtomicInteger loseClaimsAfterLostCommit = new AtomicInteger();
	/** How many of the next claims the server "refuses" (42501, as without a grant). */
	public final AtomicInteger refuseClaims = new AtomicInteger();

	/** Losses in front of real. */
	public LossyDataSource(DataSource real) {
		this.real = real;
	}

	@Override
	public Connection getConnection() throws SQLException {
		Connection c = real.getConnection();
		return (Connection) Proxy.newProxyInstance(getClass().getClassLoader(), new Class<?>[] {Connection.class},
				(proxy, method, args) -> {
					if (method.getName().equals("commit")) {
						if (take(loseCommitsAfter)) {
							c.commit();
							loseClaims.addAndGet(loseClaimsAfterLostCommit.getAndSet(0));
							throw lost(c);
						}
						if (take(loseCommitsBefore)) {
							c.rollback();
							throw lost(c);
						}
					}
					Object result = invoke(c, method, args);
					if (method.getName().equals("prepareStatement") && args[0] instanceof String sql) {
						return statement(c, (PreparedStatement) result, sql);
					}
					return result;
				});
	}

	/** st, losing or refusing its answer when that is armed for its SQL. */
	private PreparedStatement statement(Connection c, PreparedStatement st, String sql) {
		return (PreparedStatement) Proxy.newProxyInstance(getClass().getClassLoader(),
				new Class<?>[] {PreparedStatement.class}, (proxy, method, args) -> {
					if (method.getName().equals("executeQuery")) {
						if (sql.contains("idempotency.claim(") && take(refuseClaims)) {
							throw new SQLException("permission denied for function claim", "42501");
						}
						if (sql.contains("idempotency.claim(") && take(loseClaims)) {
							st.executeQuery().close();
							throw lost(c);
						}
					}
					if (method.getName().equals("execute") && sql.contains("idempotency.complete(")) {
						return completing(c, st, sql.contains("COMMIT"));
					}
					return invoke(st, method, args);
				});
	}

	/**
	 * Runs st, a complete (with the COMMIT when withCommit), losing its answer when that is armed:
	 * complete ran and the connection dropped before the COMMIT (loseCompletes), the COMMIT ran
	 * (loseCommitsAfter) or did not (loseCommitsBefore).
	 */
	private boolean completing(Connection c, PreparedStatement st, boolean withCommit) throws SQLException {
		if (take(loseCompletes) || (withCommit && take(loseCommitsBefore))) {
			throw lost(c); // the transaction rolls back with the connection
		}
		boolean result = st.execute();
		if (withCommit && take(loseCommitsAfter)) {
			loseClaims.addAndGet(loseClaimsAfterLostCommit.getAndSet(0));
			throw lost(c);
		}
		return result;
	}

	/** Aborts c (the pool discards it) and returns the error a dropped connection gives. */
	private static SQLException lost(Connection c) {
		try {
			c.abort(Runnable::run);
		} catch (SQLException ignored) {
			// gone already
		}
		return new SQLException("An I/O error occurred while sending to the backend.", "08006");
	}

	/** Takes one from n when it is above 0. */
	private static boolean take(AtomicInteger n) {
		return n.getAndUpdate(v -> v > 0 ? v - 1 : 0) > 0;
	}

	/** Calls method on target, throwing what it throws. */
	private static Object invoke(Object target, java.lang.reflect.Method method, Object[] args) throws Throwable {
		try {
			return method.invoke(target, args);
		} catch (InvocationTargetException e) {
			throw e.getCause();
		}
	}

	@Override
	public Connection getConnection(String user, String password) throws SQLException {
		throw new SQLFeatureNotSupportedException();
	}

	@Override
	public PrintWriter getLogWriter() throws SQLException {
		return real.getLogWriter();
	}

	@Override
	public void setLogWriter(PrintWriter out) throws SQLException {
		real.setLogWriter(out);
	}

	@Override
	public void setLoginTimeout(int seconds) throws SQLException {
		real.setLoginTimeout(seconds);
	}

	@Override
	public int getLoginTimeout() throws SQLException {
		return real.getLoginTimeout();
	}

	@Override
	public Logger getParentLogger() throws SQLFeatureNotSupportedException {
		return real.getParentLogger();
	}

	@Override
	public <T> T unwrap(Class<T> iface) throws SQLException {
		return real.unwrap(iface);
	}

	@Override
	public boolean isWrapperFor(Class<?> iface) throws SQLException {
		return real.isWrapperFor(iface);
	}
}
