package io.github.idempotency.function;

import static org.junit.jupiter.api.Assertions.assertEquals;

import io.github.idempotency.TestDb;
import io.github.idempotency.bench.CountingSocketFactory;
import java.io.PrintWriter;
import java.lang.reflect.Proxy;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.SQLException;
import java.util.concurrent.atomic.AtomicLong;
import java.util.logging.Logger;
import javax.sql.DataSource;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/**
 * The function's round trips are the filter's in the same mode (README, "Round trips in each mode",
 * counted by bench/overhead as ReadyForQuery messages): a fresh key 4 messages with the work's one
 * insert in either mode; a replay 1 with two transactions, 3 with one.
 */
class FunctionRoundTripsIT {
	static Connection physical;
	static AtomicLong messages;
	static DataSource pool;

	@BeforeAll
	static void connect() throws SQLException {
		String name = "function-" + System.nanoTime();
		physical = DriverManager.getConnection(TestDb.url() + (TestDb.url().contains("?") ? "&" : "?")
				+ "sslmode=disable&socketFactory=" + CountingSocketFactory.class.getName() + "&socketFactoryArg=" + name);
		messages = CountingSocketFactory.ROUND_TRIPS.get(name);
		pool = single();
		try (var st = physical.createStatement()) {
			st.execute("CREATE TABLE IF NOT EXISTS fn_charges (id bigserial PRIMARY KEY, key text NOT NULL, amount int)");
		}
	}

	@AfterAll
	static void close() throws SQLException {
		physical.close();
	}

	/** Messages of one call of a function inserting one row, on the one physical connection. */
	static long messagesOf(String key, boolean oneTransaction) throws Exception {
		long before = messages.get();
		IdempotentFunction.run(pool, key, FunctionOptions.of(FunctionIT.Charge.class).args(1)
				.oneTransaction(oneTransaction), tx -> FunctionIT.charge(tx, key, 1));
		return messages.get() - before;
	}

	@Test
	void aFreshKeyAndAReplayCostWhatTheFilterCosts() throws Exception {
		for (boolean one : new boolean[] {false, true}) {
			messagesOf(TestDb.uniqueKey("rt"), one); // the two-transaction mode reads the lease setting once per pool
			String key = TestDb.uniqueKey("rt");
			assertEquals(4, messagesOf(key, one), "fresh key, one transaction: " + one);
			assertEquals(one ? 3 : 1, messagesOf(key, one), "replay, one transaction: " + one);
		}
	}

	/** A DataSource handing out the one physical connection (closing it gives it back, open). */
	static DataSource single() {
		Connection c = (Connection) Proxy.newProxyInstance(FunctionRoundTripsIT.class.getClassLoader(),
				new Class<?>[] {Connection.class}, (proxy, method, args) -> {
					if (method.getName().equals("close")) {
						return null;
					}
					try {
						return method.invoke(physical, args);
					} catch (java.lang.reflect.InvocationTargetException e) {
						throw e.getCause();
					}
				});
		return new DataSource() {
			@Override
			public Connection getConnection() {
				return c;
			}

			@Override
			public Connection getConnection(String user, String password) {
				return c;
			}

			@Override
			public PrintWriter getLogWriter() {
				return null;
			}

			@Override
			public void setLogWriter(PrintWriter out) {
			}

			@Override
			public void setLoginTimeout(int seconds) {
			}

			@Override
			public int getLoginTimeout() {
				return 0;
			}

			@Override
			public Logger getParentLogger() {
				return Logger.getGlobal();
			}

			@Override
			public <T> T unwrap(Class<T> iface) throws SQLException {
				throw new SQLException("not a wrapper");
			}

			@Override
			public boolean isWrapperFor(Class<?> iface) {
				return false;
			}
		};
	}
}
