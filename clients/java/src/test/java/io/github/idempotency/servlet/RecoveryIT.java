package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * Lost answers (docs/http-contract.md, "When an answer is lost"), each played on the real database by
 * {@link LossyDataSource}, and concurrency through a pool smaller than the requests.
 */
class RecoveryIT {
	private static final String ALICE = FilterIT.ALICE;
	private static HikariDataSource pool;
	private LossyDataSource lossy;
	private PaymentServlet servlet;
	private TomcatServer server;

	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS filter_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		TestDb.sql("TRUNCATE filter_charges");
		pool = TestDb.pool(4);
	}

	@AfterAll
	static void closePool() {
		pool.close();
	}

	@BeforeEach
	void start() throws Exception {
		lossy = new LossyDataSource(pool);
		servlet = new PaymentServlet("filter_charges");
		server = new TomcatServer(servlet, new IdempotencyFilter(lossy, new JdbcRequestTransactions(lossy), options()));
	}

	/** The filter's options: the defaults. */
	IdempotencyOptions options() {
		return new IdempotencyOptions();
	}

	@AfterEach
	void stop() throws Exception {
		server.close();
	}

	private Http.Response pay(String body, String key) throws Exception {
		return Http.post(server.port(), "/payments", ALICE, body, key);
	}

	/** One charge, the handler's 201 naming it, a completed record, a retry replayed. */
	private void exactlyOnce(Http.Response r, String key, long amount) throws Exception {
		assertEquals(201, r.status(), r.text());
		assertNull(r.header("Idempotent-Replayed"));
		assertEquals(1, FilterIT.charges(amount));
		String id = TestDb.sql("SELECT id FROM filter_charges WHERE amount = " + amount);
		assertEquals("{\"charge\":" + id + "}", r.text());
		assertEquals("completed", FilterIT.state(key, FilterIT.scopeOf(ALICE)));
		Http.Response retry = pay("{\"amount\":" + amount + "}", key);
		assertEquals("true", retry.header("Idempotent-Replayed"));
		assertEquals(r.text(), retry.text());
	}

	@Test
	void claimsAnswerLostIsAskedAgainWithTheToken() throws Exception {
		String key = TestDb.uniqueKey("lost-claim");
		lossy.loseClaims.set(3); // the 4th try answers: new, the same fence
		exactlyOnce(pay("{\"amount\":201}", key), key, 201);
		assertEquals(1, servlet.runs.get());
	}

	@Test
	void claimsAnswerAlwaysLostIs503AndNothingRuns() throws Exception {
		String key = TestDb.uniqueKey("lost-claims");
		lossy.loseClaims.set(4);
		Http.Response r = pay("{\"amount\":202}", key);
		assertEquals(503, r.status());
		assertEquals("idempotency_unavailable", r.problemCode());
		assertEquals(0, servlet.runs.get());
		assertEquals(0, FilterIT.charges(202));
	}

	@Test
	void commitThatCommittedUnheardIsTheHandlersAnswer() throws Exception {
		String key = TestDb.uniqueKey("lost-commit");
		lossy.loseCommitsAfter.set(1);
		exactlyOnce(pay("{\"amount\":203}", key), key, 203);
		assertEquals(1, servlet.runs.get());
	}

	@Test
	void commitThatRolledBackUnheardRunsTheHandlerAgain() throws Exception {
		String key = TestDb.uniqueKey("lost-rollback");
		lossy.loseCommitsBefore.set(1);
		exactlyOnce(pay("{\"amount\":204}", key), key, 204);
		assertEquals(2, servlet.runs.get());
	}

	@Test
	void completesAnswerLostRunsTheHandlerAgain() throws Exception {
		String key = TestDb.uniqueKey("lost-complete");
		lossy.loseCompletes.set(1);
		exactlyOnce(pay("{\"amount\":205}", key), key, 205);
		assertEquals(2, servlet.runs.get());
	}

	@Test
	void commitsAlwaysRolledBackReleaseAfterThreeRuns() throws Exception {
		String key = TestDb.uniqueKey("lost-rollbacks");
		lossy.loseCommitsBefore.set(3);
		Http.Response r = pay("{\"amount\":206}", key);
		assertEquals(503, r.status());
		assertEquals(3, servlet.runs.get());
		assertEquals(0, FilterIT.charges(206));
		assertNull(FilterIT.state(key, FilterIT.scopeOf(ALICE)));
	}

	@Test
	void lostCommitWhoseClaimsGetNoAnswerSaysUnknown() throws Exception {
		String key = TestDb.uniqueKey("lost-unknown");
		lossy.loseCommitsAfter.set(1);
		lossy.loseClaimsAfterLostCommit.set(4); // and every claim that asks what happened
		Http.Response r = pay("{\"amount\":207}", key);
		assertEquals(503, r.status());
		assertTrue(r.text().contains("retry with the same Idempotency-Key"), r.text());
		lossy.loseClaims.set(0);
		Http.Response retry = pay("{\"amount\":207}", key);
		assertEquals("true", retry.header("Idempotent-Replayed"));
		assertEquals(1, FilterIT.charges(207));
	}

	@Test
	void sixteenConcurrentRequestsThroughAPoolOfFourChargeOnce() throws Exception {
		String key = TestDb.uniqueKey("herd");
		ExecutorService clients = Executors.newFixedThreadPool(16);
		try {
			List<Future<Http.Response>> answers = new ArrayList<>();
			for (int i = 0; i < 16; i++) {
				answers.add(clients.submit(() -> pay("{\"amount\":208,\"delay_ms\":300}", key)));
			}
			String charged = null;
			for (Future<Http.Response> f : answers) {
				Http.Response r = f.get(60, TimeUnit.SECONDS);
				assertTrue(Set.of(201, 409).contains(r.status()), r.status() + " " + r.text());
				if (r.status() == 201) {
					assertTrue(charged == null || charged.equals(r.text()));
					charged = r.text();
				}
			}
		} finally {
			clients.shutdownNow();
		}
		assertEquals(1, FilterIT.charges(208));
		assertEquals(1, servlet.runs.get());
		assertTrue(pool.getHikariPoolMXBean().getTotalConnections() <= 4);
	}
}
