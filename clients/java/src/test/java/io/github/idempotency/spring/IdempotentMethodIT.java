package io.github.idempotency.spring;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import io.github.idempotency.TestDb;
import io.github.idempotency.function.IdempotentCallException;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.SpringBootConfiguration;
import org.springframework.boot.autoconfigure.EnableAutoConfiguration;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.context.annotation.Bean;
import org.springframework.jdbc.core.simple.JdbcClient;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;

/** @Idempotent on a bean's method: the key from SpEL, JdbcClient writes commit with the stored result. */
@SpringBootTest(classes = IdempotentMethodIT.App.class, webEnvironment = SpringBootTest.WebEnvironment.NONE,
		properties = "spring.autoconfigure.exclude=" + SpringIT.NO_JPA)
class IdempotentMethodIT {
	/** What the method returns. */
	record Charge(long id, int amount) {
	}

	/** A service with an idempotent method. */
	static class Billing {
		final AtomicInteger runs = new AtomicInteger();
		private final JdbcClient jdbc;

		Billing(JdbcClient jdbc) {
			this.jdbc = jdbc;
		}

		/** How many times charge ran (the bean is a proxy: through a method). */
		public int runs() {
			return runs.get();
		}

		@Idempotent(key = "#orderId", scope = "'billing'", finalErrors = IllegalArgumentException.class)
		public Charge charge(String orderId, int amount) {
			runs.incrementAndGet();
			long id = jdbc.sql("INSERT INTO fn_charges (key, amount) VALUES (?, ?) RETURNING id")
					.params(orderId, amount).query(Long.class).single();
			if (amount < 0) {
				throw new IllegalArgumentException("a negative amount");
			}
			if (amount == 0) {
				throw new IllegalStateException("try again");
			}
			return new Charge(id, amount);
		}
	}

	@SpringBootConfiguration
	@EnableAutoConfiguration
	static class App {
		@Bean
		Billing billing(JdbcClient jdbc) {
			return new Billing(jdbc);
		}
	}

	@Autowired
	Billing billing;

	@DynamicPropertySource
	static void database(DynamicPropertyRegistry registry) {
		registry.add("spring.datasource.url", TestDb::url);
	}

	@BeforeAll
	static void createTable() throws Exception {
		TestDb.sql("CREATE TABLE IF NOT EXISTS fn_charges (id bigserial PRIMARY KEY, key text NOT NULL, amount int)");
	}

	static int charges(String key) throws Exception {
		return Integer.parseInt(TestDb.sql("SELECT count(*) FROM fn_charges WHERE key = '" + key + "'"));
	}

	@Test
	void runsOnceAndReplaysTheReturnType() throws Exception {
		String order = TestDb.uniqueKey("order");
		int before = billing.runs();
		Charge first = billing.charge(order, 250);
		assertEquals(first, billing.charge(order, 250));
		assertEquals(before + 1, billing.runs());
		assertEquals(1, charges(order));
		assertEquals("billing", TestDb.sql("SELECT scope FROM idempotency.keys WHERE key = '" + order + "'"));
		assertThrows(IdempotentCallException.Mismatch.class, () -> billing.charge(order, 251));
	}

	@Test
	void anErrorRollsBackItsWritesAndAFinalOneIsKept() throws Exception {
		String order = TestDb.uniqueKey("order");
		assertThrows(IllegalStateException.class, () -> billing.charge(order, 0));
		assertEquals(0, charges(order));
		assertThrows(IllegalStateException.class, () -> billing.charge(order, 0)); // released: runs again

		String refused = TestDb.uniqueKey("order");
		assertThrows(IllegalArgumentException.class, () -> billing.charge(refused, -1));
		int runs = billing.runs();
		assertThrows(IdempotentCallException.Stored.class, () -> billing.charge(refused, -1));
		assertEquals(runs, billing.runs());
		assertEquals(0, charges(refused));
	}
}
