package io.github.idempotency.jpa;

import static org.junit.jupiter.api.Assertions.assertEquals;

import io.github.idempotency.TestDb;
import org.junit.jupiter.api.Test;
import org.springframework.boot.test.context.SpringBootTest;

/** The auto-configured filter in a Spring Data JPA app, two transactions (the default). */
@SpringBootTest(classes = JpaPaymentsApp.class, webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
		properties = {"spring.datasource.hikari.maximum-pool-size=4", "spring.jpa.hibernate.ddl-auto=none",
				"spring.jpa.open-in-view=false"})
class JpaIT extends JpaTests {

	/** A claim lost while the handler ran: complete fails (IK001) and the repository's writes roll back. */
	@Test
	void aLostClaimRollsTheRepositoryWritesBack() throws Exception {
		String key = TestDb.uniqueKey("jpa");
		String reference = TestDb.uniqueKey("ref");
		assertEquals(409, pay(key, body(404, reference, ",\"stolen\":true,\"key\":\"" + key + "\"")).status());
		assertEquals(0, charges(reference));
	}
}
