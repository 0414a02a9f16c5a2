package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import jakarta.servlet.Filter;
import jakarta.servlet.http.HttpServletRequestWrapper;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Duration;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/** The filter on plain JDBC in an embedded Tomcat: every row of docs/http-contract.md. */
class FilterIT {
	static final String ALICE = "Bearer sk_test_alice";
	static final String BOB = "Bearer sk_test_bob";
	private static HikariDataSource pool;
	private LossyDataSource lossy;
	PaymentServlet servlet;
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

	/** The filter's options: a lease of 1 s. */
	IdempotencyOptions options() {
		return new IdempotencyOptions().lease(Duration.ofSeconds(1));
	}

	@AfterEach
	void stop() throws Exception {
		server.close();
	}

	Http.Response pay(String credential, String body, String... keys) throws Exception {
		return Http.post(server.port(), "/payments", credential, body, keys);
	}

	static long charges(long amount) throws Exception {
		return Long.parseLong(TestDb.sql("SELECT count(*) FROM filter_charges WHERE amount = " + amount));
	}

	static String scopeOf(String credential) throws Exception {
		return HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256")
				.digest(("authorization:" + credential).getBytes(StandardCharsets.UTF_8)));
	}

	/** A filter that authenticates every request as acct_42, as Spring Security would. */
	static final Filter AUTHENTICATE = (req, res, chain) -> chain.doFilter(
			new HttpServletRequestWrapper((jakarta.servlet.http.HttpServletRequest) req) {
				@Override
				public java.security.Principal getUserPrincipal() {
					return () -> "acct_42";
				}
			}, res);

	static String state(String key, String scope) throws Exception {
		return TestDb.sql("SELECT state FROM idempotency.lookup('" + key + "', '" + scope + "')");
	}

	@Test
	void firstReplayBareMismatch() throws Exception {
		String key = TestDb.uniqueKey("order");
		Http.Response first = pay(ALICE, "{\"amount\":101}", "\"" + key + "\"");
		assertEquals(201, first.status());
		assertTrue(first.text().matches("\\{\"charge\":[0-9]+\\}"), first.text());
		assertTrue(first.header("Content-Type").startsWith("application/json"));
		assertNull(first.header("Idempotent-Replayed"));
		Http.Response again = pay(ALICE, "{\"amount\":101}", "\"" + key + "\"");
		assertEquals(201, again.status());
		assertEquals("true", again.header("Idempotent-Replayed"));
		assertArrayEquals(first.body(), again.body());
		assertEquals(first.header("Content-Type"), again.header("Content-Type"));
		Http.Response bare = pay(ALICE, "{\"amount\":101}", key);
		assertEquals("true", bare.header("Idempotent-Replayed"));
		assertArrayEquals(first.body(), bare.body());
		assertEquals("idempotency_key_mismatch", pay(ALICE, "{\"amount\":99}", key).problemCode());
		Http.Response bob = pay(BOB, "{\"amount\":101}", key);
		assertEquals(201, bob.status());
		assertNull(bob.header("Idempotent-Replayed"));
		assertNotEquals(first.text(), bob.text());
		assertEquals(2, charges(101));
		assertEquals(1, servlet.runs.get() - 1);
		assertEquals("completed", state(key, scopeOf(ALICE)));
		assertEquals("0", TestDb.sql("SELECT count(*) FROM idempotency.keys WHERE scope ~ 'sk_test'"));
	}

	@Test
	void badKeys() throws Exception {
		Http.Response missing = pay(ALICE, "{\"amount\":1}");
		assertEquals(400, missing.status());
		assertEquals("idempotency_key_missing", missing.problemCode());
		assertTrue(missing.text().contains("\"title\":\"Bad Request\""));
		for (String bad : List.of("\"unterminated", "\"abc\";x=1", "?1", ":YWJj:", "(a b)", "\"\"", "\"a\\qb\"",
				"\"a\", \"b\"", "a b", "\"" + "k".repeat(256) + "\"")) {
			Http.Response r = pay(ALICE, "{\"amount\":1}", bad);
			assertEquals(400, r.status(), bad);
			assertEquals("idempotency_key_invalid", r.problemCode(), bad);
		}
		assertEquals("idempotency_key_invalid", pay(ALICE, "{\"amount\":1}", "\"a\"", "\"b\"").problemCode());
		assertEquals(0, servlet.runs.get());
		Http.Response escaped = pay(ALICE, "{\"amount\":102}", "\"say \\\"hi\\\" \\\\ bye\"");
		assertEquals(201, escaped.status());
		assertEquals("completed", TestDb.sql("SELECT state FROM idempotency.lookup('say \"hi\" \\ bye', '"
				+ scopeOf(ALICE) + "')"));
		TestDb.sql("SELECT idempotency.release(key, 0) FROM idempotency.keys WHERE false");
		TestDb.sql("DELETE FROM idempotency.keys WHERE key = 'say \"hi\" \\ bye'");
	}

	@Test
	void inProgressIs409WithRetryAfter() throws Exception {
		String key = TestDb.uniqueKey("slow");
		Thread slow = new Thread(() -> {
			try {
				pay(ALICE, "{\"amount\":103,\"delay_ms\":700}", key);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		slow.start();
		for (int i = 0; i < 200 && !"in_progress".equals(state(key, scopeOf(ALICE))); i++) {
			Thread.sleep(25);
		}
		Http.Response busy = pay(ALICE, "{\"amount\":103,\"delay_ms\":700}", key);
		slow.join();
		assertEquals(409, busy.status());
		assertEquals("idempotency_key_in_progress", busy.problemCode());
		assertTrue(Integer.parseInt(busy.header("Retry-After")) >= 1);
		assertEquals(1, charges(103));
	}

	@Test
	void serverErrorRollsBackAndReleases() throws Exception {
		String key = TestDb.uniqueKey("fail");
		Http.Response fail = pay(ALICE, "{\"amount\":104,\"fail\":true}", key);
		assertEquals(500, fail.status());
		assertNull(state(key, scopeOf(ALICE)));
		Http.Response again = pay(ALICE, "{\"amount\":104,\"fail\":true}", key);
		assertEquals(500, again.status());
		assertNull(again.header("Idempotent-Replayed"));
		assertNotEquals(fail.text(), again.text());
		assertEquals(0, charges(104));
	}

	@Test
	void handlerThatThrowsRollsBackAndReleases() throws Exception {
		String key = TestDb.uniqueKey("throw");
		assertEquals(500, pay(ALICE, "{\"amount\":105,\"throw\":true}", key).status());
		assertNull(state(key, scopeOf(ALICE)));
		assertEquals(0, charges(105));
	}

	@Test
	void claimLostToATakeoverIs409AndRollsBack() throws Exception {
		String key = TestDb.uniqueKey("lease");
		Http.Response[] first = new Http.Response[1];
		Thread slow = new Thread(() -> {
			try {
				first[0] = pay(ALICE, "{\"amount\":106,\"delay_ms\":2500}", key);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		slow.start();
		for (int i = 0; i < 200; i++) {
			String ended = TestDb.sql("SELECT lease_expires_at < clock_timestamp() FROM idempotency.lookup('" + key
					+ "', '" + scopeOf(ALICE) + "')");
			if ("t".equals(ended)) {
				break;
			}
			Thread.sleep(50);
		}
		Http.Response takeover = pay(ALICE, "{\"amount\":106,\"delay_ms\":2500}", key);
		slow.join();
		assertEquals(201, takeover.status());
		assertEquals(409, first[0].status());
		assertEquals("idempotency_claim_lost", first[0].problemCode());
		assertEquals("1", first[0].header("Retry-After"));
		assertEquals(1, charges(106));
	}

	@Test
	void failsClosedAndOpen() throws Exception {
		String key = TestDb.uniqueKey("refused");
		lossy.refuseClaims.set(1);
		Http.Response refused = pay(ALICE, "{\"amount\":107}", key);
		assertEquals(503, refused.status());
		assertEquals("idempotency_unavailable", refused.problemCode());
		assertEquals("1", refused.header("Retry-After"));
		assertEquals(0, servlet.runs.get());
		server.close();
		server = new TomcatServer(servlet, new IdempotencyFilter(lossy, new JdbcRequestTransactions(lossy),
				new IdempotencyOptions().failOpen(true)));
		lossy.refuseClaims.set(1);
		assertEquals(201, pay(ALICE, "{\"amount\":107}", key).status());
		assertNull(state(key, scopeOf(ALICE)));
		assertEquals(1, charges(107));
	}

	@Test
	void unreachableDatabaseIs503() throws Exception {
		com.zaxxer.hikari.HikariConfig config = new com.zaxxer.hikari.HikariConfig();
		config.setJdbcUrl("jdbc:postgresql://127.0.0.1:1/none?connectTimeout=2");
		config.setConnectionTimeout(1000);
		config.setInitializationFailTimeout(-1);
		try (HikariDataSource down = new HikariDataSource(config);
				TomcatServer s = new TomcatServer(servlet, new IdempotencyFilter(down))) {
			Http.Response r = Http.post(s.port(), "/payments", ALICE, "{\"amount\":108}", "down-1");
			assertEquals(503, r.status());
			assertEquals("idempotency_unavailable", r.problemCode());
			assertEquals(0, servlet.runs.get());
		}
	}

	@Test
	void keyOptionalRunsUnguardedAndOtherMethodsPass() throws Exception {
		server.close();
		server = new TomcatServer(servlet, new IdempotencyFilter(lossy, new JdbcRequestTransactions(lossy),
				new IdempotencyOptions().keyOptional(true)));
		assertEquals(201, pay(ALICE, "{\"amount\":109}").status());
		assertEquals(1, charges(109));
		Http.Response get = Http.send(server.port(), "GET", "/", List.of(), new byte[0]);
		assertEquals(405, get.status()); // the servlet's own answer: GET passes the filter untouched
	}

	@Test
	void scopeIsTheCredentialsHashAsInEveryClientWhateverThePrincipal() throws Exception {
		server.close();
		server = new TomcatServer(servlet, AUTHENTICATE, new IdempotencyFilter(lossy));
		String key = TestDb.uniqueKey("principal");
		assertEquals(201, pay(ALICE, "{\"amount\":110}", key).status());
		assertEquals("completed", state(key, scopeOf(ALICE)));
		assertNull(state(key, "acct_42"));
	}

	@Test
	void scopeIsThePrincipalWhenTheOptionSaysSo() throws Exception {
		server.close();
		server = new TomcatServer(servlet, AUTHENTICATE, new IdempotencyFilter(lossy,
				new JdbcRequestTransactions(lossy), new IdempotencyOptions().scope(r -> r.getUserPrincipal().getName())));
		String key = TestDb.uniqueKey("principal");
		assertEquals(201, pay(ALICE, "{\"amount\":114}", key).status());
		assertEquals("completed", state(key, "acct_42"));
	}

	@Test
	void contentEncodingIsStoredWithTheBody() throws Exception {
		Filter compress = (req, res, chain) -> { // as a compression filter inside the idempotency filter would
			((jakarta.servlet.http.HttpServletResponse) res).setHeader("Content-Encoding", "br");
			chain.doFilter(req, res);
		};
		server.close();
		server = new TomcatServer(servlet, new IdempotencyFilter(lossy), compress);
		String key = TestDb.uniqueKey("encoding");
		assertEquals("br", pay(ALICE, "{\"amount\":116}", key).header("Content-Encoding"));
		Http.Response again = pay(ALICE, "{\"amount\":116}", key);
		assertEquals("true", again.header("Idempotent-Replayed"));
		assertEquals("br", again.header("Content-Encoding"));
	}

	@Test
	void scopeHashesTheCredentialsBytesAsSent() throws Exception {
		String zoe = "Bearer sk_test_zo\u00eb";
		byte[] sent = zoe.getBytes(StandardCharsets.UTF_8); // what curl sends for a UTF-8 terminal's zoë
		String key = TestDb.uniqueKey("utf8");
		assertEquals(201, pay(new String(sent, StandardCharsets.ISO_8859_1), "{\"amount\":115}", key).status());
		assertEquals("completed", state(key, scopeOf(zoe))); // SHA-256 of "authorization:" and the bytes sent
	}

	@Test
	void storedServerErrorIsReplayed() throws Exception {
		com.zaxxer.hikari.HikariConfig config = new com.zaxxer.hikari.HikariConfig();
		config.setJdbcUrl(TestDb.url());
		config.setMaximumPoolSize(2);
		config.setConnectionInitSql("SET idempotency.store_server_errors = on");
		try (HikariDataSource storing = new HikariDataSource(config);
				TomcatServer s = new TomcatServer(servlet, new IdempotencyFilter(storing,
						new JdbcRequestTransactions(storing), options()))) {
			String key = TestDb.uniqueKey("stored5xx");
			Http.Response fail = Http.post(s.port(), "/payments", ALICE, "{\"amount\":111,\"fail\":true}", key);
			Http.Response again = Http.post(s.port(), "/payments", ALICE, "{\"amount\":111,\"fail\":true}", key);
			assertEquals(500, again.status());
			assertEquals("true", again.header("Idempotent-Replayed"));
			assertArrayEquals(fail.body(), again.body());
			assertEquals(0, charges(111));
			assertEquals(1, servlet.runs.get());
		}
	}
}
