package io.github.idempotency.spring;

import static org.junit.jupiter.api.Assertions.assertEquals;

import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.Http;
import org.junit.jupiter.api.Test;
import org.springframework.boot.test.context.SpringBootTest;

/**
 * SpringIT with {@code idempotency.one-transaction=true}: the claim joins the transaction manager's
 * transaction with the JdbcTemplate and {@code @Transactional} writes and complete; no lease is taken
 * over, a duplicate waits for the first and replays it.
 */
@SpringBootTest(classes = {PaymentsApp.class, SpringIT.Telemetry.class},
		webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
		properties = {"spring.datasource.hikari.maximum-pool-size=4", "idempotency.lease=2s",
				"idempotency.one-transaction=true", "spring.autoconfigure.exclude=" + SpringIT.NO_JPA})
class OneTransactionSpringIT extends SpringIT {

	/** A handler past its lease is not taken over: the retry waits and replays its answer. */
	@Test
	@Override
	void claimLostToATakeoverRollsBackTheJdbcTemplateWrite() throws Exception {
		String key = TestDb.uniqueKey("spring-lease");
		Http.Response[] first = new Http.Response[1];
		Thread slow = new Thread(() -> {
			try {
				first[0] = pay("/payments", "{\"amount\":307,\"delay_ms\":3000}", key);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		slow.start();
		io.github.idempotency.servlet.OneTransactionFilterIT.awaitUncommittedClaim();
		Thread.sleep(2100); // past the lease of 2 s
		Http.Response retry = pay("/payments", "{\"amount\":307,\"delay_ms\":3000}", key);
		slow.join();
		assertEquals(201, first[0].status());
		assertEquals("true", retry.header("Idempotent-Replayed"));
		assertEquals(first[0].text(), retry.text());
		assertEquals(1, charges(307));
	}
}
