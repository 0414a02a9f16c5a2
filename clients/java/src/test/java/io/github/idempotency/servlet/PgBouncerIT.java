package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.ClaimRequest;
import io.github.idempotency.ClaimResult;
import io.github.idempotency.Fingerprint;
import io.github.idempotency.Idempotency;
import io.github.idempotency.PgBouncer;
import io.github.idempotency.TestDb;
import io.github.idempotency.spring.SpringRequestTransactions;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import javax.sql.DataSource;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.Assumptions;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.jdbc.datasource.DataSourceTransactionManager;

/**
 * The client and the filter through pgbouncer 1.18 in transaction pooling, with pgjdbc's and HikariCP's
 * defaults: pgjdbc makes a statement a named server-side one after its fifth use on a connection
 * (prepareThreshold 5), and the next transaction may run on another server connection, where that
 * name does not exist (26000) or is another client's (42P05). The client's statements must never be
 * named. Skipped, saying why, without /usr/sbin/pgbouncer.
 */
class PgBouncerIT {
	private static PgBouncer bouncer;

	@BeforeAll
	static void start() throws Exception {
		Assumptions.assumeTrue(PgBouncer.available(), "no pgbouncer at " + PgBouncer.BINARY + " (Debian: apt-get install pgbouncer)");
		TestDb.sql("CREATE TABLE IF NOT EXISTS pooled_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		TestDb.sql("TRUNCATE pooled_charges");
		bouncer = new PgBouncer();
	}

	@AfterAll
	static void stop() throws Exception {
		if (bouncer != null) {
			bouncer.close();
		}
	}

	/** A HikariCP pool through pgbouncer, with its defaults and pgjdbc's but for the size. */
	private static HikariDataSource pool(int size) {
		HikariConfig config = new HikariConfig();
		config.setJdbcUrl(bouncer.url());
		config.setMaximumPoolSize(size);
		return new HikariDataSource(config);
	}

	@Test
	void theCoreOnOneConnectionWhoseServerConnectionsChange() throws Exception {
		byte[] fp = Fingerprint.of("POST", "/pooled", null, null);
		String prefix = TestDb.uniqueKey("pooled");
		try (Connection c = DriverManager.getConnection(bouncer.url());
				Connection other = DriverManager.getConnection(bouncer.url())) {
			// More calls on one connection than pgjdbc's prepareThreshold.
			for (int n = 0; n < 8; n++) {
				ClaimResult r = Idempotency.claim(c, ClaimRequest.of("", prefix + n, fp));
				assertTrue(r instanceof ClaimResult.New, r.toString());
				((ClaimResult.New) r).complete(c, 201, new byte[] {'{', '}'}, null);
			}
			// Another client holds the server connection those calls used: the next calls run on the other.
			other.setAutoCommit(false);
			try (Statement st = other.createStatement()) {
				st.execute("SELECT 1");
			}
			for (int n = 0; n < 8; n++) {
				assertEquals("REPLAY", Idempotency.claim(c, ClaimRequest.of("", prefix + n, fp)).outcome().name());
			}
			other.rollback();
		}
	}

	@Test
	void theFilterOnPlainJdbc() throws Exception {
		filterWithFreshKeysReplaysAndConcurrentDuplicates(3000, JdbcRequestTransactions::new);
	}

	@Test
	void theFilterInSpringsTransactions() throws Exception {
		filterWithFreshKeysReplaysAndConcurrentDuplicates(4000,
				ds -> new SpringRequestTransactions(new DataSourceTransactionManager(ds), ds));
	}

	/**
	 * 24 fresh keys from 4 clients at once (amounts from base), their replays, and 8 concurrent
	 * duplicates of one key (amount base + 100), through the filter with transactions made by tx.
	 */
	private static void filterWithFreshKeysReplaysAndConcurrentDuplicates(int base,
			Function<DataSource, RequestTransactions> tx) throws Exception {
		try (HikariDataSource pool = pool(4)) {
			PaymentServlet servlet = new PaymentServlet("pooled_charges");
			IdempotencyFilter filter = new IdempotencyFilter(pool, tx.apply(pool), new IdempotencyOptions());
			try (TomcatServer server = new TomcatServer(servlet, filter)) {
				ExecutorService clients = Executors.newFixedThreadPool(8);
				try {
					String prefix = TestDb.uniqueKey("pooled");
					// 24 fresh keys from 4 clients at once: each pooled connection runs the client's
					// statements more than 5 times, on server connections the 4 share 2 of.
					List<Future<Http.Response>> fresh = new ArrayList<>();
					for (int n = 0; n < 24; n++) {
						String body = "{\"amount\":" + (base + n) + "}";
						String key = "\"" + prefix + "-" + n + "\"";
						fresh.add(clients.submit(() -> Http.post(server.port(), "/payments", FilterIT.ALICE, body, key)));
					}
					List<String> charges = new ArrayList<>();
					for (Future<Http.Response> f : fresh) {
						Http.Response r = f.get(60, TimeUnit.SECONDS);
						assertEquals(201, r.status(), r.text());
						charges.add(r.text());
					}
					for (int n = 0; n < 24; n++) {
						Http.Response r = Http.post(server.port(), "/payments", FilterIT.ALICE,
								"{\"amount\":" + (base + n) + "}", "\"" + prefix + "-" + n + "\"");
						assertEquals(201, r.status(), r.text());
						assertEquals("true", r.header("Idempotent-Replayed"));
						assertEquals(charges.get(n), r.text());
					}
					assertEquals(24, servlet.runs.get());

					String herd = "\"" + prefix + "-herd\"";
					List<Future<Http.Response>> duplicates = new ArrayList<>();
					for (int i = 0; i < 8; i++) {
						duplicates.add(clients.submit(() -> Http.post(server.port(), "/payments", FilterIT.ALICE,
								"{\"amount\":" + (base + 100) + ",\"delay_ms\":300}", herd)));
					}
					Set<String> charged = new HashSet<>();
					for (Future<Http.Response> f : duplicates) {
						Http.Response r = f.get(60, TimeUnit.SECONDS);
						assertTrue(Set.of(201, 409).contains(r.status()), r.status() + " " + r.text());
						if (r.status() == 201) {
							charged.add(r.text());
						}
					}
					assertEquals(1, charged.size());
					assertEquals(25, servlet.runs.get());
				} finally {
					clients.shutdownNow();
				}
			}
		}
		assertEquals("24", TestDb.sql("SELECT count(*) FROM pooled_charges WHERE amount BETWEEN " + base + " AND "
				+ (base + 23)));
		assertEquals("1", TestDb.sql("SELECT count(*) FROM pooled_charges WHERE amount = " + (base + 100)));
	}
}
