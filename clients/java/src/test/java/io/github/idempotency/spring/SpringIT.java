package io.github.idempotency.spring;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.Spans;
import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.Http;
import io.github.idempotency.servlet.IdempotencyFilter;
import io.opentelemetry.api.OpenTelemetry;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import javax.sql.DataSource;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.boot.test.context.TestConfiguration;
import org.springframework.boot.test.web.server.LocalServerPort;
import org.springframework.context.annotation.Bean;
import org.springframework.jdbc.datasource.DataSourceTransactionManager;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;
import org.springframework.transaction.PlatformTransactionManager;

/** The auto-configuration in a Spring Boot app: JdbcTemplate and @Transactional writes commit with complete. */
@SpringBootTest(classes = {PaymentsApp.class, SpringIT.Telemetry.class}, webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
		properties = {"spring.datasource.hikari.maximum-pool-size=4", "idempotency.lease=2s",
				"spring.autoconfigure.exclude=" + SpringIT.NO_JPA})
class SpringIT {
	/** JPA is on the tests' class path (JpaIT): these stay on JDBC's transaction manager. */
	static final String NO_JPA = "org.springframework.boot.hibernate.autoconfigure.HibernateJpaAutoConfiguration,"
			+ "org.springframework.boot.data.jpa.autoconfigure.DataJpaRepositoriesAutoConfiguration";
	private static final String ALICE = "Bearer sk_test_alice";

	@LocalServerPort
	int port;
	@Autowired
	DataSource dataSource;
	@Autowired
	IdempotencyFilter filter;
	@Autowired
	Spans spans;
	@Autowired
	PlatformTransactionManager transactionManager;

	/** The application's OpenTelemetry: an SDK with the in-memory exporter. */
	@TestConfiguration
	static class Telemetry {
		@Bean
		Spans spans() {
			return new Spans();
		}

		@Bean
		OpenTelemetry openTelemetry(Spans spans) {
			return spans.sdk;
		}
	}

	@DynamicPropertySource
	static void database(DynamicPropertyRegistry registry) {
		registry.add("spring.datasource.url", TestDb::url);
	}

	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS spring_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		TestDb.sql("TRUNCATE spring_charges");
		TestDb.sql("CREATE TABLE IF NOT EXISTS spring_outbox (marker text, kind text, xid text)");
	}

	Http.Response pay(String path, String body, String key) throws Exception {
		return Http.post(port, path, ALICE, body, key);
	}

	static long charges(long amount) throws Exception {
		return Long.parseLong(TestDb.sql("SELECT count(*) FROM spring_charges WHERE amount = " + amount));
	}

	private static String state(String key) throws Exception {
		return TestDb.sql("SELECT state FROM idempotency.lookup('" + key + "', encode(sha256('authorization:"
				+ ALICE + "'), 'hex'))");
	}

	@Test
	void autoConfiguredOnTheApplicationsPool() {
		assertTrue(dataSource instanceof HikariDataSource);
		assertTrue(filter != null);
		assertTrue(transactionManager instanceof DataSourceTransactionManager, transactionManager.getClass().getName());
	}

	@Test
	void spansGoToTheApplicationsOpenTelemetry() throws Exception {
		String key = TestDb.uniqueKey("secret-key");
		assertEquals(201, pay("/payments", "{\"amount\":31337}", key).status());
		assertEquals(201, pay("/payments", "{\"amount\":31337}", key).status());
		assertEquals(List.of("idempotency.claim new", "idempotency.complete stored", "idempotency.claim replay"),
				spans.summary(key));
		spans.assertClean(key, "secret-key", "31337", "sk_test_alice");
	}

	@Test
	void jdbcTemplateWritesCommitWithTheStoredResponse() throws Exception {
		String key = TestDb.uniqueKey("spring");
		Http.Response first = pay("/payments", "{\"amount\":301}", key);
		assertEquals(201, first.status(), first.text());
		assertTrue(first.text().matches("\\{\"charge\":[0-9]+\\}"), first.text());
		assertTrue(first.header("Content-Type").startsWith("application/json"));
		Http.Response again = pay("/payments", "{\"amount\":301}", key);
		assertEquals("true", again.header("Idempotent-Replayed"));
		assertArrayEquals(first.body(), again.body());
		assertEquals(first.header("Content-Type"), again.header("Content-Type"));
		assertEquals(1, charges(301));
		assertEquals("completed", state(key));
		assertEquals("idempotency_key_missing", Http.post(port, "/payments", ALICE, "{\"amount\":301}").problemCode());
	}

	@Test
	void transactionalServiceJoinsTheTransaction() throws Exception {
		String key = TestDb.uniqueKey("service");
		assertEquals(201, pay("/service-payments", "{\"amount\":302}", key).status());
		assertEquals("completed", state(key));
		String failing = TestDb.uniqueKey("service-throw");
		assertEquals(500, pay("/service-payments", "{\"amount\":303,\"throw\":true}", failing).status());
		assertEquals(0, charges(303)); // the service's write rolled back with the handler's failure
		assertNull(state(failing));
	}

	@Test
	void beforeCommitCallbacksRunInTheTransactionOfCompleteAndTheWrites() throws Exception {
		String key = TestDb.uniqueKey("outbox");
		assertEquals(201, pay("/outbox-payments", "{\"marker\":\"" + key + "\"}", key).status());
		assertEquals("completed", state(key));
		assertEquals("2|1", TestDb.sql("SELECT count(*) || '|' || count(DISTINCT xid) FROM spring_outbox"
				+ " WHERE marker = '" + key + "'"));
	}

	@Test
	void failingHandlersCommitNothingAndReleaseTheKey() throws Exception {
		String key = TestDb.uniqueKey("spring-fail");
		assertEquals(500, pay("/payments", "{\"amount\":304,\"fail\":true}", key).status());
		assertNull(state(key));
		assertEquals(500, pay("/payments", "{\"amount\":305,\"throw\":true}", key).status());
		assertNull(state(key));
		assertEquals(0, charges(304) + charges(305));
	}

	@Test
	void asyncHandlersAreRefusedAndCommitNothing() throws Exception {
		String key = TestDb.uniqueKey("async");
		Http.Response r = pay("/async-payments", "{\"amount\":306}", key);
		assertEquals(500, r.status());
		assertNull(state(key));
		Thread.sleep(200); // a Callable, had it started, would have written by now
		assertEquals(0, charges(306));
	}

	@Test
	void claimLostToATakeoverRollsBackTheJdbcTemplateWrite() throws Exception {
		String key = TestDb.uniqueKey("spring-lease");
		Http.Response[] first = new Http.Response[1];
		Thread slow = new Thread(() -> {
			try {
				first[0] = pay("/payments", "{\"amount\":307,\"delay_ms\":3500}", key);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		slow.start();
		for (int i = 0; i < 200; i++) {
			if ("t".equals(TestDb.sql("SELECT lease_expires_at < clock_timestamp() FROM idempotency.lookup('" + key
					+ "', encode(sha256('authorization:" + ALICE + "'), 'hex'))"))) {
				break;
			}
			Thread.sleep(50);
		}
		Http.Response takeover = pay("/payments", "{\"amount\":307,\"delay_ms\":3500}", key);
		slow.join();
		assertEquals(201, takeover.status());
		assertEquals(409, first[0].status());
		assertEquals("idempotency_claim_lost", first[0].problemCode());
		assertEquals(1, charges(307));
	}

	@Test
	void sixteenConcurrentRequestsThroughAPoolOfFourChargeOnce() throws Exception {
		String key = TestDb.uniqueKey("spring-herd");
		int before = PaymentsApp.Payments.RUNS.get();
		ExecutorService clients = Executors.newFixedThreadPool(16);
		try {
			List<Future<Http.Response>> answers = new ArrayList<>();
			for (int i = 0; i < 16; i++) {
				answers.add(clients.submit(() -> pay("/payments", "{\"amount\":308,\"delay_ms\":300}", key)));
			}
			for (Future<Http.Response> f : answers) {
				Http.Response r = f.get(60, TimeUnit.SECONDS);
				assertTrue(Set.of(201, 409).contains(r.status()), r.status() + " " + r.text());
			}
		} finally {
			clients.shutdownNow();
		}
		assertEquals(1, charges(308));
		assertEquals(1, PaymentsApp.Payments.RUNS.get() - before);
		assertTrue(((HikariDataSource) dataSource).getHikariPoolMXBean().getTotalConnections() <= 4);
	}
}
