package io.github.idempotency;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.SQLException;
import java.sql.Statement;
import java.time.Duration;
import java.time.OffsetDateTime;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** The client against the extension: every outcome, the owner operations, the errors, the fingerprint. */
class ClientIT {
	private static HikariDataSource pool;
	private static final byte[] FP = Fingerprint.of("POST", "/payments", "{}".getBytes(StandardCharsets.UTF_8), null);

	@BeforeAll
	static void open() {
		pool = TestDb.pool(4);
	}

	@AfterAll
	static void close() {
		pool.close();
	}

	private static ClaimResult claim(String key) throws SQLException {
		return Idempotency.claim(pool, ClaimRequest.of("acct", key, FP));
	}

	@Test
	void newThenReplayWithTheStoredResponse() throws SQLException {
		String key = TestDb.uniqueKey("replay");
		ClaimResult.New ticket = assertInstanceOf(ClaimResult.New.class, claim(key));
		assertEquals(1, ticket.attempt());
		assertEquals(Outcome.NEW, ticket.outcome());
		byte[] body = {0, 1, 2, (byte) 0xff, '{', '}'};
		try (Connection c = pool.getConnection()) {
			c.setAutoCommit(false);
			assertEquals(ClaimResult.Completion.STORED, ticket.complete(c, 201, body,
					Map.of("Content-Type", List.of("application/json"), "X-Many", List.of("a", "b"))));
			c.commit();
		}
		ClaimResult.Replay replay = assertInstanceOf(ClaimResult.Replay.class, claim(key));
		assertEquals(201, replay.statusCode());
		assertArrayEquals(body, replay.body());
		assertEquals(List.of("application/json"), replay.headers().get("Content-Type"));
		assertEquals(List.of("a", "b"), replay.headers().get("X-Many"));
		assertEquals(ticket.createdAt().toInstant(), replay.createdAt().toInstant());
	}

	@Test
	void storedHeadersComeBackAsStoredThroughClaimAndLookup() throws SQLException {
		String key = TestDb.uniqueKey("headers");
		ClaimResult.New ticket = assertInstanceOf(ClaimResult.New.class, claim(key));
		Map<String, List<String>> headers = new java.util.LinkedHashMap<>();
		headers.put("X-Quote", List.of("say \"hi\" \\ back/slash, {x: [1]}"));
		headers.put("X-Control", List.of("tab\there\u0001\u001f"));
		headers.put("X-Unicode", List.of("caf\u00e9 \u20ac \ud83d\ude00", ""));
		headers.put("Content-Type", List.of("application/json"));
		try (Connection c = pool.getConnection()) {
			c.setAutoCommit(false);
			ticket.complete(c, 200, null, headers);
			c.commit();
		}
		Map<String, List<String>> byName = new java.util.TreeMap<>(headers);
		ClaimResult.Replay replay = assertInstanceOf(ClaimResult.Replay.class, claim(key));
		assertEquals(List.copyOf(byName.entrySet()), List.copyOf(replay.headers().entrySet()));
		try (Connection c = pool.getConnection()) {
			assertEquals(List.copyOf(byName.entrySet()),
					List.copyOf(Idempotency.lookup(c, "acct", key).orElseThrow().headers().entrySet()));
		}
	}

	@Test
	void inProgressThenMismatch() throws SQLException {
		String key = TestDb.uniqueKey("busy");
		assertInstanceOf(ClaimResult.New.class, claim(key));
		ClaimResult.InProgress busy = assertInstanceOf(ClaimResult.InProgress.class, claim(key));
		assertTrue(busy.retryAfter() >= 1);
		byte[] other = Fingerprint.of("POST", "/payments", "{\"x\":1}".getBytes(StandardCharsets.UTF_8), null);
		assertEquals(Outcome.MISMATCH, Idempotency.claim(pool, ClaimRequest.of("acct", key, other)).outcome());
		// Another scope never meets the key.
		assertEquals(Outcome.NEW, Idempotency.claim(pool, ClaimRequest.of("other", key, other)).outcome());
	}

	@Test
	void serverErrorIsReleasedAndReleaseFrees() throws SQLException {
		String key = TestDb.uniqueKey("5xx");
		ClaimResult.New ticket = (ClaimResult.New) claim(key);
		try (Connection c = pool.getConnection()) {
			assertEquals(ClaimResult.Completion.RELEASED, ticket.complete(c, 503, null, null));
		}
		ClaimResult.New again = assertInstanceOf(ClaimResult.New.class, claim(key));
		assertNotEquals(ticket.fence(), again.fence());
		try (Connection c = pool.getConnection()) {
			assertTrue(again.release(c));
			assertFalse(again.release(c));
		}
		assertEquals(Outcome.NEW, claim(key).outcome());
	}

	@Test
	void takeoverFencesTheOldOwnerAndHandsOnTheCheckpoint() throws Exception {
		String key = TestDb.uniqueKey("takeover");
		ClaimRequest req = ClaimRequest.of("acct", key, FP).withLease(Duration.ofMillis(300));
		ClaimResult.New first = (ClaimResult.New) Idempotency.claim(pool, req);
		try (Connection c = pool.getConnection()) {
			first.checkpoint(c, "charged", "{\"charge\": 7}");
			OffsetDateTime end = first.extend(c, Duration.ofMillis(300));
			assertTrue(end.isAfter(OffsetDateTime.now().minusMinutes(1)));
		}
		Thread.sleep(600);
		ClaimResult.New second = assertInstanceOf(ClaimResult.New.class, Idempotency.claim(pool, req));
		assertEquals(2, second.attempt());
		assertTrue(second.fence() > first.fence());
		assertEquals("charged", second.recoveryPoint());
		assertEquals("{\"charge\": 7}", second.recoveryState());
		try (Connection c = pool.getConnection()) {
			ClaimLostException lost = assertThrows(ClaimLostException.class, () -> first.complete(c, 200, null, null));
			assertEquals("IK001", lost.getSQLState());
			assertThrows(ClaimLostException.class, () -> first.extend(c, null));
			assertThrows(ClaimLostException.class, () -> first.checkpoint(c, "x", null));
			assertFalse(first.release(c));
		}
	}

	@Test
	void theSameTokenResumesItsOwnClaim() throws SQLException {
		String key = TestDb.uniqueKey("token");
		UUID token = Idempotency.newToken();
		ClaimRequest req = ClaimRequest.of("acct", key, FP).withToken(token);
		ClaimResult.New first = (ClaimResult.New) Idempotency.claim(pool, req);
		ClaimResult.New again = assertInstanceOf(ClaimResult.New.class, Idempotency.claim(pool, req));
		assertEquals(first.fence(), again.fence());
		assertEquals(Outcome.IN_PROGRESS, Idempotency.claim(pool, req.withToken(Idempotency.newToken())).outcome());
		assertEquals(4, token.version());
	}

	@Test
	void waitForTheOwner() throws Exception {
		String key = TestDb.uniqueKey("wait");
		ClaimResult.New ticket = (ClaimResult.New) claim(key);
		Thread releaser = new Thread(() -> {
			try (Connection c = pool.getConnection()) {
				Thread.sleep(300);
				ticket.complete(c, 200, "done".getBytes(StandardCharsets.UTF_8), null);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		releaser.start();
		ClaimResult r = Idempotency.claim(pool, ClaimRequest.of("acct", key, FP).withWait(Duration.ofSeconds(20)));
		releaser.join();
		assertEquals(Outcome.REPLAY, r.outcome());
	}

	@Test
	void lookupShowsTheRecordWithoutItsFence() throws SQLException {
		String key = TestDb.uniqueKey("lookup");
		try (Connection c = pool.getConnection()) {
			assertTrue(Idempotency.lookup(c, "acct", key).isEmpty());
			ClaimResult.New ticket = (ClaimResult.New) claim(key);
			KeyRecord inProgress = Idempotency.lookup(c, "acct", key).orElseThrow();
			assertEquals("in_progress", inProgress.state());
			assertNull(inProgress.statusCode());
			assertTrue(inProgress.lease().toSeconds() > 0);
			ticket.complete(c, 201, "ok".getBytes(StandardCharsets.UTF_8), Map.of("Location", List.of("/p/1")));
			KeyRecord done = Idempotency.lookup(c, "acct", key).orElseThrow();
			assertEquals("completed", done.state());
			assertEquals(201, done.statusCode());
			assertEquals(List.of("/p/1"), done.headers().get("Location"));
			assertArrayEquals(FP, done.fingerprint());
			assertTrue(done.expiresAt().isAfter(done.createdAt()));
		}
	}

	@Test
	void sqlStatesAsExceptions() throws Exception {
		InvalidArgumentException tooLong = assertThrows(InvalidArgumentException.class, () -> claim("k".repeat(256)));
		assertEquals("22023", tooLong.getSQLState());
		assertThrows(InvalidArgumentException.class, () -> claim(""));
		assertEquals("22004", assertThrows(InvalidArgumentException.class,
				() -> Idempotency.claim(pool, ClaimRequest.of("acct", "k", null))).getSQLState());
		assertThrows(InvalidArgumentException.class,
				() -> Idempotency.claim(pool, ClaimRequest.of("acct", "k", FP).withLease(Duration.ofSeconds(-1))));
		// 54000: a response over idempotency.max_response_bytes; the claim stays as it was.
		String key = TestDb.uniqueKey("big");
		ClaimResult.New ticket = (ClaimResult.New) claim(key);
		try (Connection c = TestDb.connect(); Statement st = c.createStatement()) {
			st.execute("SET idempotency.max_response_bytes = '1kB'");
			assertEquals("54000", assertThrows(InvalidArgumentException.class,
					() -> ticket.complete(c, 200, new byte[4096], null)).getSQLState());
			assertEquals("in_progress", Idempotency.lookup(c, "acct", key).orElseThrow().state());
		}
	}

	@Test
	void lockTimeoutIsRetryable() throws Exception {
		String key = TestDb.uniqueKey("locked");
		try (Connection holder = TestDb.connect(); Connection waiter = TestDb.connect()) {
			holder.setAutoCommit(false);
			assertEquals(Outcome.NEW, Idempotency.claim(holder, ClaimRequest.of("acct", key, FP)).outcome());
			try (Statement st = waiter.createStatement()) {
				st.execute("SET lock_timeout = '200ms'");
			}
			RetryableException e = assertThrows(RetryableException.class,
					() -> Idempotency.claim(waiter, ClaimRequest.of("acct", key, FP)));
			assertEquals("55P03", e.getSQLState());
			holder.rollback();
		}
	}

	@Test
	void serializationFailureIsRetryable() throws Exception {
		String key = TestDb.uniqueKey("snapshot");
		try (Connection reader = TestDb.connect(); Connection writer = TestDb.connect()) {
			reader.setAutoCommit(false);
			reader.setTransactionIsolation(Connection.TRANSACTION_REPEATABLE_READ);
			try (Statement st = reader.createStatement()) {
				st.execute("SELECT 1"); // takes the snapshot
			}
			assertEquals(Outcome.NEW, Idempotency.claim(writer, ClaimRequest.of("acct", key, FP)).outcome());
			assertEquals("40001", assertThrows(RetryableException.class,
					() -> Idempotency.claim(reader, ClaimRequest.of("acct", key, FP))).getSQLState());
			reader.rollback();
		}
	}

	@Test
	void readOnlyTransactionIsRefused() throws Exception {
		try (Connection c = TestDb.connect()) {
			c.setAutoCommit(false);
			c.setReadOnly(true);
			IdempotencyException e = assertThrows(IdempotencyException.class, () -> Idempotency.claim(c,
					ClaimRequest.of("acct", TestDb.uniqueKey("ro"), FP)));
			assertEquals("25006", e.getSQLState());
			c.rollback();
		}
	}

	@Test
	void fingerprintEqualsTheDatabases() throws SQLException {
		byte[][] bodies = {null, new byte[0], "{\"amount\":10}".getBytes(StandardCharsets.UTF_8),
				{0, (byte) 0x80, (byte) 0xff, 10}, "é".getBytes(StandardCharsets.UTF_8)};
		String[] queries = {null, "", "a=1&b=%20"};
		String[][] parts = {{"POST", "/payments"}, {"post", "/payments"}, {"PaTcH", "/a"}, {"POST", "/ab"},
				{"POST", "/é/ü"}, {"ÿost", "/"}};
		try (Connection c = pool.getConnection()) {
			for (String[] p : parts) {
				for (byte[] body : bodies) {
					for (String q : queries) {
						assertArrayEquals(Idempotency.fingerprint(c, p[0], p[1], body, q),
								Fingerprint.of(p[0], p[1], body, q), p[0] + " " + p[1] + " " + q);
					}
				}
			}
		}
	}
}
