package example.jobs;

import io.github.idempotency.TransactionCommands;
import io.github.idempotency.servlet.RequestTransactions;
import java.io.PrintWriter;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Proxy;
import java.sql.Connection;
import java.sql.SQLException;
import java.sql.SQLFeatureNotSupportedException;
import java.util.logging.Logger;
import javax.sql.DataSource;

/**
 * JOBS_ACK=transaction: db-scheduler's acknowledgment (its removal of the execution) commits in the
 * task's own transaction, with the charge and the stored result. db-scheduler documents that its
 * completion "runs using a new Connection from the DataSource provided" and that making it part of a
 * transaction is the DataSource's business; it completes an execution on the thread that ran it, right
 * after the task returns, and does not commit a connection in autocommit off (it leaves that to whoever
 * manages the transaction, unless commitWhenAutocommitDisabled). So this is both the scheduler's
 * DataSource and the function's source of transactions: the task's transaction is not committed when
 * the function is done with it, but handed to the scheduler's next connection request on that thread
 * (the removal), and committed when the scheduler closes that connection. A worker killed before then
 * loses all three together, and the execution is delivered again.
 */
final class AckInTransaction implements DataSource, RequestTransactions {
	private final DataSource pool;
	/** The task's transaction, done with, awaiting the acknowledgment (on the thread that ran it). */
	private final ThreadLocal<Connection> pending = new ThreadLocal<>();

	AckInTransaction(DataSource pool) {
		this.pool = pool;
	}

	/** Whether JOBS_ACK=transaction. */
	static boolean on() {
		return "transaction".equals(System.getenv("JOBS_ACK"));
	}

	@Override
	public RequestTransaction begin() throws SQLException {
		Connection c = pool.getConnection();
		c.setAutoCommit(false);
		return new RequestTransaction() {
			private boolean ended;

			@Override
			public Connection connection() {
				return c;
			}

			@Override
			public boolean readyToComplete() {
				return false; // complete without the COMMIT: the acknowledgment joins first
			}

			@Override
			public void commit() {
				ended = true;
				Connection unclaimed = pending.get();
				if (unclaimed != null) {
					end(unclaimed, false); // the scheduler never acknowledged the last task: its run rolls back
				}
				pending.set(c);
			}

			@Override
			public void rollback() {
				if (ended) {
					return;
				}
				ended = true;
				end(c, false);
			}
		};
	}

	@Override
	public Connection getConnection() throws SQLException {
		Connection c = pending.get();
		if (c == null) {
			return pool.getConnection();
		}
		pending.remove();
		return (Connection) Proxy.newProxyInstance(getClass().getClassLoader(), new Class<?>[] {Connection.class},
				(proxy, method, args) -> {
					if (method.getName().equals("close")) {
						end(c, true);
						if ("after-commit".equals(System.getenv("JOBS_CRASH"))) {
							Jobs.crash("after-commit: the charge and the acknowledgment committed together");
						}
						return null;
					}
					try {
						return method.invoke(c, args);
					} catch (InvocationTargetException e) {
						throw e.getCause();
					}
				});
	}

	/** Commits (or rolls back) c's transaction and gives c back to the pool in autocommit. */
	private static void end(Connection c, boolean commit) {
		try (c) {
			if (commit) {
				TransactionCommands.commit(c);
			} else {
				TransactionCommands.rollback(c);
			}
			c.setAutoCommit(true);
		} catch (SQLException e) {
			throw new IllegalStateException("the task's transaction did not " + (commit ? "commit" : "roll back"), e);
		}
	}

	@Override
	public Connection getConnection(String user, String password) throws SQLException {
		return getConnection();
	}

	@Override
	public PrintWriter getLogWriter() throws SQLException {
		return pool.getLogWriter();
	}

	@Override
	public void setLogWriter(PrintWriter out) throws SQLException {
		pool.setLogWriter(out);
	}

	@Override
	public void setLoginTimeout(int seconds) throws SQLException {
		pool.setLoginTimeout(seconds);
	}

	@Override
	public int getLoginTimeout() throws SQLException {
		return pool.getLoginTimeout();
	}

	@Override
	public Logger getParentLogger() throws SQLFeatureNotSupportedException {
		return pool.getParentLogger();
	}

	@Override
	public <T> T unwrap(Class<T> iface) throws SQLException {
		return pool.unwrap(iface);
	}

	@Override
	public boolean isWrapperFor(Class<?> iface) throws SQLException {
		return pool.isWrapperFor(iface);
	}
}
