package io.github.idempotency.jpa;

import org.springframework.boot.test.context.SpringBootTest;

/** The auto-configured filter in a Spring Data JPA app, one transaction. */
@SpringBootTest(classes = JpaPaymentsApp.class, webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
		properties = {"spring.datasource.hikari.maximum-pool-size=4", "spring.jpa.hibernate.ddl-auto=none",
				"spring.jpa.open-in-view=false", "idempotency.one-transaction=true"})
class OneTransactionJpaIT extends JpaTests {
}
