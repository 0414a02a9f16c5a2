package io.github.idempotency.jpa;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.Http;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.test.web.server.LocalServerPort;
import org.springframework.orm.jpa.JpaTransactionManager;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;
import org.springframework.transaction.PlatformTransactionManager;

/** What JpaIT and OneTransactionJpaIT check in their mode: a handler's repository writes commit with complete. */
abstract class JpaTests {
	static final String ALICE = "Bearer sk_test_alice";

	@LocalServerPort
	int port;
	@Autowired
	PlatformTransactionManager transactionManager;

	@DynamicPropertySource
	static void database(DynamicPropertyRegistry registry) {
		registry.add("spring.datasource.url", TestDb::url);
	}

	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE SEQUENCE IF NOT EXISTS jpa_charges_seq");
		TestDb.sql("CREATE TABLE IF NOT EXISTS jpa_charges (id bigint PRIMARY KEY, amount bigint NOT NULL,"
				+ " reference text UNIQUE)");
	}

	Http.Response pay(String key, String body) throws Exception {
		return Http.post(port, "/payments", ALICE, body, key);
	}

	static String body(long amount, String reference, String more) {
		return "{\"amount\":" + amount + ",\"reference\":\"" + reference + "\"" + more + "}";
	}

	static long charges(String reference) throws Exception {
		return Long.parseLong(TestDb.sql("SELECT count(*) FROM jpa_charges WHERE reference = '" + reference + "'"));
	}

	static String state(String key) throws Exception {
		return TestDb.sql("SELECT state FROM idempotency.lookup('" + key + "', encode(sha256('authorization:"
				+ ALICE + "'), 'hex'))");
	}

	@Test
	void theApplicationsTransactionManagerIsJpas() {
		assertTrue(transactionManager instanceof JpaTransactionManager, transactionManager.getClass().getName());
	}

	@Test
	void repositoryWritesCommitWithTheStoredResponse() throws Exception {
		String key = TestDb.uniqueKey("jpa");
		String reference = TestDb.uniqueKey("ref");
		Http.Response first = pay(key, body(401, reference, ""));
		assertEquals(201, first.status());
		assertEquals("completed", state(key));
		assertEquals(1, charges(reference));
		Http.Response again = pay(key, body(401, reference, ""));
		assertEquals(201, again.status());
		assertEquals("true", again.header("Idempotent-Replayed"));
		assertArrayEquals(first.body(), again.body());
		assertEquals(1, charges(reference));
	}

	/**
	 * The repository's INSERT fails only when the transaction manager flushes it, after the handler
	 * answered 201: nothing is kept and the key is free, as for a write the server refuses at COMMIT.
	 */
	@Test
	void aWriteRefusedAtTheFlushRollsBackAndFreesTheKey() throws Exception {
		String reference = TestDb.uniqueKey("ref");
		assertEquals(201, pay(TestDb.uniqueKey("jpa"), body(402, reference, "")).status());
		String key = TestDb.uniqueKey("jpa");
		Http.Response refused = pay(key, body(402, reference, ""));
		assertEquals(503, refused.status());
		assertEquals(1, charges(reference));
		assertNull(state(key));
	}

	@Test
	void aHandlerThatThrowsAfterSavingRollsBack() throws Exception {
		String key = TestDb.uniqueKey("jpa");
		String reference = TestDb.uniqueKey("ref");
		assertEquals(500, pay(key, body(403, reference, ",\"throw\":true")).status());
		assertEquals(0, charges(reference));
		assertNull(state(key));
		assertEquals(201, pay(key, body(403, reference, "")).status()); // another request: the key is free
	}
}
