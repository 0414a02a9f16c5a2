package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.standardwebhooks.Webhook;
import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.concurrent.atomic.AtomicBoolean;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** The filter's webhook key sources (Standard Webhooks, a body field) and its redact hook. */
class WebhooksIT {
	static final String SECRET = "whsec_" + Base64.getEncoder().encodeToString("a receiver's secret".getBytes(StandardCharsets.UTF_8));
	static final String OTHER = "whsec_" + Base64.getEncoder().encodeToString("someone else's".getBytes(StandardCharsets.UTF_8));
	private static HikariDataSource pool;

	@BeforeAll
	static void setUp() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS webhook_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		TestDb.sql("TRUNCATE webhook_charges");
		pool = TestDb.pool(4);
	}

	@AfterAll
	static void closePool() {
		pool.close();
	}

	static TomcatServer server(IdempotencyOptions options) throws Exception {
		return new TomcatServer(new PaymentServlet("webhook_charges"), new IdempotencyFilter(pool,
				new JdbcRequestTransactions(pool), options));
	}

	/** Delivers body as event id, signed with secret at timestamp (seconds). */
	static Http.Response deliver(TomcatServer server, String secret, String id, long timestamp, String body)
			throws Exception {
		List<String> lines = new ArrayList<>();
		lines.add("webhook-id: " + id);
		lines.add("webhook-timestamp: " + timestamp);
		lines.add("webhook-signature: " + new Webhook(secret).sign(id, timestamp, body));
		lines.add("Content-Type: application/json");
		return Http.send(server.port(), "POST", "/payments", lines, body.getBytes(StandardCharsets.UTF_8));
	}

	static long now() {
		return System.currentTimeMillis() / 1000;
	}

	static long charges(long amount) throws Exception {
		return Long.parseLong(TestDb.sql("SELECT count(*) FROM webhook_charges WHERE amount = " + amount));
	}

	@Test
	void aStandardWebhookIsVerifiedKeyedByItsIdAndScopedBySender() throws Exception {
		String id = TestDb.uniqueKey("msg");
		try (TomcatServer server = server(Webhooks.standard(new IdempotencyOptions(), new Webhook(SECRET), "acme"))) {
			Http.Response first = deliver(server, SECRET, id, now(), "{\"amount\":901}");
			assertEquals(201, first.status(), first.text());
			Http.Response again = deliver(server, SECRET, id, now() + 1, "{\"amount\":901}");
			assertEquals(201, again.status());
			assertArrayEquals(first.body(), again.body());
			assertEquals("true", again.header("Idempotent-Replayed"));
			assertEquals(1, charges(901));
			assertEquals("webhook:acme", TestDb.sql("SELECT scope FROM idempotency.keys WHERE key = '" + id + "'"));
			assertEquals(422, deliver(server, SECRET, id, now(), "{\"amount\":902}").status());

			String forged = TestDb.uniqueKey("msg");
			assertEquals(401, deliver(server, OTHER, forged, now(), "{\"amount\":903}").status());
			assertEquals(401, deliver(server, SECRET, forged, now() - 600, "{\"amount\":903}").status());
			assertEquals(0, charges(903));
			assertNull(TestDb.sql("SELECT key FROM idempotency.keys WHERE key = '" + forged + "'"), "nothing claimed");
		}
	}

	@Test
	void aKeyFromTheBody() throws Exception {
		String id = TestDb.uniqueKey("evt");
		try (TomcatServer server = server(new IdempotencyOptions().key(Webhooks.bodyKey("id")))) {
			String event = "{\"id\": \"" + id + "\", \"amount\":911}";
			Http.Response first = Http.post(server.port(), "/payments", null, event);
			assertEquals(201, first.status(), first.text());
			Http.Response again = Http.post(server.port(), "/payments", null, event);
			assertArrayEquals(first.body(), again.body());
			assertEquals(1, charges(911));
			assertEquals(400, Http.post(server.port(), "/payments", null, "{\"amount\":912}").status());
			assertEquals(400, Http.post(server.port(), "/payments", null, "{\"id\": 7, \"amount\":912}").status());
			assertEquals(0, charges(912));
		}
	}

	@Test
	void redactChangesWhatIsStoredNotWhatIsSent() throws Exception {
		String key = "\"" + TestDb.uniqueKey("redact") + "\"";
		byte[] masked = "{\"charge\":\"redacted\"}".getBytes(StandardCharsets.UTF_8);
		try (TomcatServer server = server(new IdempotencyOptions()
				.redact((status, headers, body) -> new IdempotencyOptions.Stored(status, headers, masked)))) {
			Http.Response first = Http.post(server.port(), "/payments", "Bearer x", "{\"amount\":921}", key);
			assertEquals(201, first.status());
			assertEquals(true, first.text().matches("\\{\"charge\":\\d+\\}"), first.text());
			Http.Response replay = Http.post(server.port(), "/payments", "Bearer x", "{\"amount\":921}", key);
			assertEquals(201, replay.status());
			assertArrayEquals(masked, replay.body());
			assertEquals(1, charges(921));
		}
	}

	@Test
	void aRedactorThatThrowsStoresNothingAndReleasesTheKey() throws Exception {
		String key = "\"" + TestDb.uniqueKey("redact") + "\"";
		AtomicBoolean fail = new AtomicBoolean(true);
		try (TomcatServer server = server(new IdempotencyOptions().redact((status, headers, body) -> {
			if (fail.get()) {
				throw new IllegalStateException("no card number to mask");
			}
			return new IdempotencyOptions.Stored(status, headers, body);
		}))) {
			Http.Response failed = Http.post(server.port(), "/payments", "Bearer x", "{\"amount\":931}", key);
			assertEquals(500, failed.status(), failed.text());
			assertTrue(failed.text().contains("\"code\":\"idempotency_redact_failed\""), failed.text());
			assertEquals(0, charges(931), "the handler's work rolled back");
			fail.set(false);
			Http.Response again = Http.post(server.port(), "/payments", "Bearer x", "{\"amount\":931}", key);
			assertEquals(201, again.status(), again.text());
			assertNull(again.header("Idempotent-Replayed"), "nothing was stored: it ran again");
			assertEquals(1, charges(931));
		}
	}
}
