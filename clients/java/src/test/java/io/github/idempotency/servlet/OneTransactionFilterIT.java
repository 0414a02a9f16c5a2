package io.github.idempotency.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.github.idempotency.TestDb;
import org.junit.jupiter.api.Test;

/**
 * FilterIT's contract with the claim in the handler's transaction: the same answers, except that a
 * request in progress is invisible until it commits, so a duplicate waits for it (2 s), then replays
 * what committed or answers 409, and no lease is ever taken over.
 */
public class OneTransactionFilterIT extends FilterIT {
	@Override
	IdempotencyOptions options() {
		return super.options().oneTransaction(true);
	}

	/** Waits until another session has written a claim it has not committed. */
	public static void awaitUncommittedClaim() throws Exception {
		for (int i = 0; i < 400; i++) {
			if ("t".equals(TestDb.sql("SELECT count(*) > 0 FROM pg_locks WHERE relation = 'idempotency.keys'::regclass"
					+ " AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid()"))) {
				return;
			}
			Thread.sleep(25);
		}
		throw new AssertionError("no claim in progress");
	}

	/** Sends body with key from a thread of its own; the response lands in into[0]. */
	private Thread payLater(String body, String key, Http.Response[] into) {
		Thread t = new Thread(() -> {
			try {
				into[0] = pay(ALICE, body, key);
			} catch (Exception e) {
				throw new RuntimeException(e);
			}
		});
		t.start();
		return t;
	}

	/** A duplicate of a request that outlasts the wait: 409 with Retry-After, after waiting; one charge. */
	@Test
	@Override
	void inProgressIs409WithRetryAfter() throws Exception {
		String key = TestDb.uniqueKey("slow");
		Http.Response[] first = new Http.Response[1];
		Thread slow = payLater("{\"amount\":103,\"delay_ms\":4000}", key, first);
		awaitUncommittedClaim();
		assertNull(state(key, scopeOf(ALICE)), "an uncommitted claim is invisible");
		long started = System.nanoTime();
		Http.Response busy = pay(ALICE, "{\"amount\":103,\"delay_ms\":4000}", key);
		assertTrue(System.nanoTime() - started >= 1_900_000_000L, "it waited for the first");
		slow.join();
		assertEquals(409, busy.status(), busy.text());
		assertEquals("idempotency_key_in_progress", busy.problemCode());
		assertTrue(Integer.parseInt(busy.header("Retry-After")) >= 1);
		assertEquals(201, first[0].status());
		assertEquals(1, charges(103));
	}

	/** A duplicate of a request that ends within the wait: the first's response, replayed. */
	@Test
	void duplicateWaitsThenReplays() throws Exception {
		String key = TestDb.uniqueKey("wait");
		Http.Response[] first = new Http.Response[1];
		Thread slow = payLater("{\"amount\":112,\"delay_ms\":500}", key, first);
		awaitUncommittedClaim();
		Http.Response again = pay(ALICE, "{\"amount\":112,\"delay_ms\":500}", key);
		slow.join();
		assertEquals(201, first[0].status());
		assertEquals("true", again.header("Idempotent-Replayed"));
		assertEquals(first[0].text(), again.text());
		assertEquals(1, charges(112));
		assertEquals(1, servlet.runs.get());
	}

	/**
	 * A handler that outlasts its lease is not taken over (nobody sees its claim): its duplicate waits
	 * and replays its answer.
	 */
	@Test
	@Override
	void claimLostToATakeoverIs409AndRollsBack() throws Exception {
		String key = TestDb.uniqueKey("lease");
		Http.Response[] first = new Http.Response[1];
		Thread slow = payLater("{\"amount\":106,\"delay_ms\":1500}", key, first);
		awaitUncommittedClaim();
		Thread.sleep(1100); // past the lease of 1 s
		Http.Response retry = pay(ALICE, "{\"amount\":106,\"delay_ms\":1500}", key);
		slow.join();
		assertEquals(201, first[0].status());
		assertEquals("true", retry.header("Idempotent-Replayed"));
		assertEquals(first[0].text(), retry.text());
		assertEquals(1, charges(106));
	}
}
