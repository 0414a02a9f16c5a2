package io.github.idempotency;

import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;

/** The test database: DATABASE_URL (a database with CREATE EXTENSION idempotency, as a superuser). */
public final class TestDb {
	private TestDb() {
	}

	/** The JDBC URL of DATABASE_URL. */
	public static String url() {
		String url = System.getenv("DATABASE_URL");
		if (url == null || url.isEmpty()) {
			throw new IllegalStateException("set DATABASE_URL to a database with CREATE EXTENSION idempotency");
		}
		return PostgresUrl.toJdbc(url);
	}

	/** A new connection, in autocommit. */
	public static Connection connect() throws SQLException {
		return DriverManager.getConnection(url());
	}

	/** A HikariCP pool of at most size connections, waiting at most 10 s for one. */
	public static HikariDataSource pool(int size) {
		HikariConfig config = new HikariConfig();
		config.setJdbcUrl(url());
		config.setMaximumPoolSize(size);
		config.setConnectionTimeout(10_000);
		return new HikariDataSource(config);
	}

	/** Runs sql and returns the first column of its first row as text (null without a row). */
	public static String sql(String sql) throws SQLException {
		try (Connection c = connect(); Statement st = c.createStatement()) {
			if (!st.execute(sql)) {
				return null;
			}
			try (ResultSet rs = st.getResultSet()) {
				return rs.next() ? rs.getString(1) : null;
			}
		}
	}

	/** A key no other test uses. */
	public static String uniqueKey(String prefix) {
		return prefix + "-" + java.util.UUID.randomUUID();
	}
}
