package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.Spans;
import io.github.idempotency.TestDb;
import java.util.List;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** The filter's spans on the tracer of its options: a fresh request, a replay, a mismatch, a 5xx. */
class FilterTelemetryIT {
	private static final String CREDENTIAL = "Bearer sk_secret_credential";
	private static HikariDataSource pool;

	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS traced_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		pool = TestDb.pool(2);
	}

	@AfterAll
	static void closePool() {
		pool.close();
	}

	@Test
	void spansOfEachAnswer() throws Exception {
		Spans spans = new Spans();
		IdempotencyFilter filter = new IdempotencyFilter(pool, new JdbcRequestTransactions(pool),
				new IdempotencyOptions().openTelemetry(spans.sdk));
		String key = TestDb.uniqueKey("secret-key");
		String failing = TestDb.uniqueKey("secret-key");
		try (TomcatServer server = new TomcatServer(new PaymentServlet("traced_charges"), filter)) {
			String body = "{\"amount\":987654321}";
			assertEquals(201, Http.post(server.port(), "/payments", CREDENTIAL, body, key).status());
			assertEquals(201, Http.post(server.port(), "/payments", CREDENTIAL, body, key).status());
			assertEquals(422, Http.post(server.port(), "/payments", CREDENTIAL, "{\"amount\":987654322}", key).status());
			assertEquals(500, Http.post(server.port(), "/payments", CREDENTIAL, "{\"amount\":987654323,\"fail\":true}",
					failing).status());
		}
		assertEquals(List.of("idempotency.claim new", "idempotency.complete stored", "idempotency.claim replay",
				"idempotency.claim mismatch"), spans.summary(key));
		assertEquals(List.of("idempotency.claim new", "idempotency.complete released"), spans.summary(failing));
		spans.assertClean(key, failing, "secret-key", "987654321", "987654322", "sk_secret_credential",
				FilterIT.scopeOf(CREDENTIAL));
	}
}
