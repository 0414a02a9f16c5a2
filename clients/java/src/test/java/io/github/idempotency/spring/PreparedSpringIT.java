package io.github.idempotency.spring;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.github.idempotency.TestDb;
import java.sql.Connection;
import java.sql.ResultSet;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.springframework.boot.test.context.SpringBootTest;

/**
 * SpringIT with {@code idempotency.prepare=true}: every behaviour the same, the filter's calls named
 * statements of the pool's connections.
 */
@SpringBootTest(classes = {PaymentsApp.class, SpringIT.Telemetry.class},
		webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
		properties = {"spring.datasource.hikari.maximum-pool-size=4", "idempotency.lease=2s",
				"idempotency.prepare=true", "spring.autoconfigure.exclude=" + SpringIT.NO_JPA})
class PreparedSpringIT extends SpringIT {

	@Test
	void theFilterCallsArePreparedStatements() throws Exception {
		String key = TestDb.uniqueKey("spring-prepared");
		assertEquals(201, pay("/payments", "{\"amount\":311}", key).status());
		assertEquals("true", pay("/payments", "{\"amount\":311}", key).header("Idempotent-Replayed"));
		List<String> named = new ArrayList<>();
		List<Connection> all = new ArrayList<>();
		try {
			for (int i = 0; i < 4; i++) { // every connection of the pool, each its own session
				all.add(dataSource.getConnection());
			}
			for (Connection c : all) {
				try (Statement st = c.createStatement(); ResultSet rs = st.executeQuery(
						"SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%idempotency.%'"
								+ " AND statement NOT LIKE '%pg_prepared_statements%'")) {
					while (rs.next()) {
						named.add(rs.getString(1));
					}
				}
			}
		} finally {
			for (Connection c : all) {
				c.close();
			}
		}
		assertTrue(named.stream().anyMatch(s -> s.contains("idempotency.claim(")), named.toString());
		assertTrue(named.stream().anyMatch(s -> s.contains("idempotency.complete(")), named.toString());
	}
}
