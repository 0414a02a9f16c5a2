package io.github.idempotency.function;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.ClaimLostException;
import io.github.idempotency.Idempotency;
import io.github.idempotency.KeyRecord;
import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.LossyDataSource;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.time.Duration;
import java.time.OffsetDateTime;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** IdempotentFunction.run against the real extension: once, replay, mismatch, errors, waits, leases, lost answers. */
class FunctionIT {
	static HikariDataSource pool;

	/** A charge: what the work returns, stored as JSON and read back. */
	record Charge(long id, int amount, List<String> tags) {
	}

	@BeforeAll
	static void setUp() throws SQLException {
		pool = TestDb.pool(8);
		TestDb.sql("CREATE TABLE IF NOT EXISTS fn_charges (id bigserial PRIMARY KEY, key text NOT NULL, amount int)");
	}

	@AfterAll
	static void tearDown() {
		pool.close();
	}

	/** The work of the tests: a charge row, in the function's transaction. */
	static Charge charge(Connection tx, String key, int amount) throws SQLException {
		try (PreparedStatement st = tx.prepareStatement("INSERT INTO fn_charges (key, amount) VALUES (?, ?) RETURNING id")) {
			st.setString(1, key);
			st.setInt(2, amount);
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				return new Charge(rs.getLong(1), amount, List.of("card"));
			}
		}
	}

	static int charges(String key) throws SQLException {
		return Integer.parseInt(TestDb.sql("SELECT count(*) FROM fn_charges WHERE key = '" + key + "'"));
	}

	static FunctionOptions<Charge> opts(int amount) {
		return FunctionOptions.of(Charge.class).args(amount);
	}

	@Test
	void runsOnceAndGivesTheStoredResultBackTyped() throws Exception {
		String key = TestDb.uniqueKey("fn");
		AtomicInteger runs = new AtomicInteger();
		Work<Charge> work = tx -> {
			runs.incrementAndGet();
			return charge(tx, key, 500);
		};
		Charge first = IdempotentFunction.run(pool, key, opts(500), work);
		Charge again = IdempotentFunction.run(pool, key, opts(500), work);
		assertEquals(first, again);
		assertEquals(1, runs.get());
		assertEquals(1, charges(key));
	}

	@Test
	void theSameKeyWithOtherArgumentsIsAMismatch() throws Exception {
		String key = TestDb.uniqueKey("fn");
		IdempotentFunction.run(pool, key, opts(500), tx -> charge(tx, key, 500));
		assertThrows(IdempotentCallException.Mismatch.class,
				() -> IdempotentFunction.run(pool, key, opts(501), tx -> charge(tx, key, 501)));
		assertEquals(1, charges(key));
	}

	@Test
	void argumentsAreCanonical() {
		assertEquals(java.util.HexFormat.of().formatHex(ResultJson.fingerprint(List.of(java.util.Map.of("b", 1, "a", 2)))),
				java.util.HexFormat.of().formatHex(ResultJson.fingerprint(List.of(new java.util.TreeMap<>(java.util.Map.of("a", 2, "b", 1))))));
	}

	@Test
	void anErrorRollsBackAndReleasesTheKey() throws Exception {
		for (boolean one : new boolean[] {true, false}) {
			String key = TestDb.uniqueKey("fn");
			assertThrows(IllegalStateException.class, () -> IdempotentFunction.run(pool, key, opts(7).oneTransaction(one), tx -> {
				charge(tx, key, 7);
				throw new IllegalStateException("card declined");
			}));
			assertEquals(0, charges(key));
			assertTrue(lookup(key).isEmpty(), "released");
			IdempotentFunction.run(pool, key, opts(7).oneTransaction(one), tx -> charge(tx, key, 7));
			assertEquals(1, charges(key));
		}
	}

	@Test
	void aFinalErrorIsStoredAndGivenBack() throws Exception {
		for (boolean one : new boolean[] {true, false}) {
			String key = TestDb.uniqueKey("fn");
			FunctionOptions<Charge> o = opts(9).oneTransaction(one).finalErrors(IllegalArgumentException.class::isInstance);
			assertThrows(IllegalArgumentException.class, () -> IdempotentFunction.run(pool, key, o, tx -> {
				charge(tx, key, 9);
				throw new IllegalArgumentException("no such card");
			}));
			AtomicInteger runs = new AtomicInteger();
			IdempotentCallException.Stored stored = assertThrows(IdempotentCallException.Stored.class,
					() -> IdempotentFunction.run(pool, key, o, tx -> {
						runs.incrementAndGet();
						return charge(tx, key, 9);
					}));
			assertEquals(IllegalArgumentException.class.getName(), stored.errorClass());
			assertEquals("no such card", stored.getMessage());
			assertEquals(0, runs.get());
			assertEquals(0, charges(key));
		}
	}

	@Test
	void aDuplicateWhileItRunsWaitsThenGetsTheResultOrInProgress() throws Exception {
		for (boolean one : new boolean[] {true, false}) {
			String key = TestDb.uniqueKey("fn");
			CountDownLatch running = new CountDownLatch(1);
			CountDownLatch finish = new CountDownLatch(1);
			CompletableFuture<Charge> first = CompletableFuture.supplyAsync(() -> call(key, opts(3).oneTransaction(one), tx -> {
				running.countDown();
				finish.await(30, TimeUnit.SECONDS);
				return charge(tx, key, 3);
			}));
			assertTrue(running.await(30, TimeUnit.SECONDS));
			if (!one) {
				// two transactions: the claim has committed; a duplicate that waits no longer is told so
				assertThrows(IdempotentCallException.InProgress.class, () -> IdempotentFunction.run(pool, key,
						opts(3).oneTransaction(false).waitFor(null), tx -> charge(tx, key, 3)));
			}
			CompletableFuture<Charge> duplicate = CompletableFuture.supplyAsync(() -> call(key,
					opts(3).oneTransaction(one).waitFor(Duration.ofSeconds(30)), tx -> charge(tx, key, 3)));
			awaitWaiting(one);
			finish.countDown();
			assertEquals(first.get(30, TimeUnit.SECONDS), duplicate.get(30, TimeUnit.SECONDS));
			assertEquals(1, charges(key));
		}
	}

	/** Waits until a claim waits: on the first one's row lock (one transaction), or in claim's wait. */
	static void awaitWaiting(boolean one) throws Exception {
		String waiting = one ? "wait_event_type = 'Lock'" : "query LIKE '%idempotency.claim%' AND state = 'active'";
		for (int i = 0; i < 3000; i++) {
			if (!"0".equals(TestDb.sql("SELECT count(*) FROM pg_stat_activity WHERE " + waiting
					+ " AND pid <> pg_backend_pid()"))) {
				return;
			}
			Thread.sleep(10);
		}
		throw new AssertionError("no claim waited");
	}

	@Test
	void twoTransactionsRenewTheLeaseWhileTheWorkRuns() throws Exception {
		String key = TestDb.uniqueKey("fn");
		FunctionOptions<Charge> o = opts(4).oneTransaction(false).lease(Duration.ofSeconds(2))
				.extendEvery(Duration.ofMillis(100));
		Charge c = IdempotentFunction.run(pool, key, o, tx -> {
			OffsetDateTime first = lookup(key).get().leaseExpiresAt();
			for (int i = 0; i < 1000 && !lookup(key).get().leaseExpiresAt().isAfter(first); i++) {
				Thread.sleep(10);
			}
			assertTrue(lookup(key).get().leaseExpiresAt().isAfter(first), "the lease was renewed");
			return charge(tx, key, 4);
		});
		assertEquals(4, c.amount());
	}

	@Test
	void aTakeoverResumesAfterTheLastCheckpoint() throws Exception {
		String key = TestDb.uniqueKey("fn");
		FunctionOptions<Charge> o = opts(5).oneTransaction(false).lease(Duration.ofSeconds(1))
				.extendEvery(Duration.ofHours(1));
		CountDownLatch checkpointed = new CountDownLatch(1);
		CountDownLatch finish = new CountDownLatch(1);
		CompletableFuture<Charge> stalled = CompletableFuture.supplyAsync(() -> call(key, o, tx -> {
			IdempotentFunction.current().checkpoint("charged", "{\"charge\": 77}");
			checkpointed.countDown();
			finish.await(30, TimeUnit.SECONDS);
			return charge(tx, key, 5);
		}));
		assertTrue(checkpointed.await(30, TimeUnit.SECONDS));
		while (!lookup(key).get().leaseExpiresAt().isBefore(OffsetDateTime.now().minusSeconds(1))) {
			Thread.sleep(50); // the stalled run's lease ends (no renewal)
		}
		Charge resumed = IdempotentFunction.run(pool, key, o, tx -> {
			IdempotentRun run = IdempotentFunction.current();
			assertEquals(2, run.attempt());
			assertEquals("charged", run.recoveryPoint());
			assertEquals("{\"charge\": 77}", run.recoveryState());
			return new Charge(77, 5, List.of("resumed"));
		});
		assertEquals(77, resumed.id());
		finish.countDown();
		ExecutionException lost = assertThrows(ExecutionException.class, () -> stalled.get(30, TimeUnit.SECONDS));
		assertTrue(lost.getCause() instanceof ClaimLostException, lost.toString());
		assertEquals(0, charges(key), "the stalled run's writes rolled back");
	}

	@Test
	void aLostCommitIsResolvedWithTheClaimToken() throws Exception {
		for (boolean one : new boolean[] {true, false}) {
			LossyDataSource lossy = new LossyDataSource(pool);
			String key = TestDb.uniqueKey("fn");
			AtomicInteger runs = new AtomicInteger();
			Work<Charge> work = tx -> {
				runs.incrementAndGet();
				return charge(tx, key, 6);
			};
			lossy.loseCommitsAfter.set(1); // committed, answer lost: the claim says replay
			Charge c = IdempotentFunction.run(lossy, key, opts(6).oneTransaction(one), work);
			assertEquals(1, runs.get());
			assertEquals(1, charges(key));
			assertEquals(c, IdempotentFunction.run(pool, key, opts(6).oneTransaction(one), work));

			String key2 = TestDb.uniqueKey("fn");
			lossy.loseCommitsBefore.set(1); // rolled back, answer lost: the claim says new, it runs again
			IdempotentFunction.run(lossy, key2, opts(6).oneTransaction(one), tx -> {
				runs.incrementAndGet();
				return charge(tx, key2, 6);
			});
			assertEquals(3, runs.get());
			assertEquals(1, charges(key2));
		}
	}

	static java.util.Optional<KeyRecord> lookup(String key) throws SQLException {
		try (Connection c = pool.getConnection()) {
			return Idempotency.lookup(c, "", key);
		}
	}

	/** run, for a CompletableFuture. */
	static <T> T call(String key, FunctionOptions<T> o, Work<T> work) {
		try {
			return IdempotentFunction.run(pool, key, o, work);
		} catch (RuntimeException e) {
			throw e;
		} catch (Exception e) {
			throw new java.util.concurrent.CompletionException(e);
		}
	}
}
