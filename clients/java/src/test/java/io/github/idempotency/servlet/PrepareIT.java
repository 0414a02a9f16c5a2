package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import java.sql.Connection;
import java.sql.ResultSet;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.CsvSource;

/**
 * The prepare option, on the server: with it, the filter's calls are named statements of the
 * connection (pg_prepared_statements); without it, none is, so that any pooler can carry them.
 */
class PrepareIT {
	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS prepare_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
	}

	@ParameterizedTest(name = "prepare={0}, oneTransaction={1}")
	@CsvSource({"true, false", "true, true", "false, false", "false, true"})
	void theFilterStatementsArePreparedOnlyWithTheOption(boolean prepare, boolean oneTransaction) throws Exception {
		try (HikariDataSource pool = TestDb.pool(1);
				TomcatServer server = new TomcatServer(new PaymentServlet("prepare_charges"),
						new IdempotencyFilter(pool, new JdbcRequestTransactions(pool),
								new IdempotencyOptions().oneTransaction(oneTransaction).prepare(prepare)))) {
			String key = UUID.randomUUID().toString();
			for (int i = 0; i < 3; i++) {
				Http.Response first = Http.post(server.port(), "/payments", FilterIT.ALICE, "{\"amount\":7}", key + i);
				assertEquals(201, first.status());
				Http.Response again = Http.post(server.port(), "/payments", FilterIT.ALICE, "{\"amount\":7}", key + i);
				assertEquals(201, again.status());
				assertEquals("true", again.header("Idempotent-Replayed"));
				assertEquals(first.text(), again.text());
			}
			assertEquals(500, Http.post(server.port(), "/payments", FilterIT.ALICE,
					"{\"amount\":7,\"fail\":true}", key + "5xx").status());
			List<String> named = named(pool);
			if (prepare) {
				assertTrue(named.stream().anyMatch(s -> s.contains("idempotency.claim(")), named.toString());
				assertTrue(named.stream().anyMatch(s -> s.contains("idempotency.complete(")), named.toString());
			} else {
				assertEquals(List.of(), named);
			}
		}
	}

	/** The statements of the pool's one connection that name the extension's functions. */
	private static List<String> named(HikariDataSource pool) throws Exception {
		List<String> named = new ArrayList<>();
		try (Connection c = pool.getConnection(); Statement st = c.createStatement();
				ResultSet rs = st.executeQuery("SELECT statement FROM pg_prepared_statements"
						+ " WHERE statement LIKE '%idempotency.%' AND statement NOT LIKE '%pg_prepared_statements%'")) {
			while (rs.next()) {
				named.add(rs.getString(1));
			}
		}
		return named;
	}
}
