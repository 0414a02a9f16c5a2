package io.github.idempotency.spring;

import io.github.idempotency.servlet.IdempotencyFilter;
import jakarta.servlet.http.HttpServletRequest;
import java.util.Map;
import java.util.concurrent.Callable;
import java.util.concurrent.atomic.AtomicInteger;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.http.ResponseEntity;
import org.springframework.jdbc.core.JdbcTemplate;
import org.springframework.stereotype.Service;
import org.springframework.transaction.annotation.Transactional;
import org.springframework.transaction.support.TransactionSynchronization;
import org.springframework.transaction.support.TransactionSynchronizationManager;
import org.springframework.web.bind.annotation.PostMapping;
import org.springframework.web.bind.annotation.RequestBody;
import org.springframework.web.bind.annotation.RestController;

/** A Spring Boot app as a team writes one: JdbcTemplate, a @Transactional service, the auto-configured filter. */
@SpringBootApplication
public class PaymentsApp {

	/** The payments service: its @Transactional method joins the filter's transaction. */
	@Service
	public static class Charges {
		private final JdbcTemplate jdbc;

		/** On jdbc. */
		public Charges(JdbcTemplate jdbc) {
			this.jdbc = jdbc;
		}

		/** Inserts a charge and returns its id. */
		@Transactional
		public long charge(long amount) {
			return jdbc.queryForObject("INSERT INTO spring_charges (amount) VALUES (?) RETURNING id", Long.class, amount);
		}
	}

	/** The routes. */
	@RestController
	public static class Payments {
		/** How many times a handler ran. */
		static final AtomicInteger RUNS = new AtomicInteger();
		private final JdbcTemplate jdbc;
		private final Charges charges;

		/** On jdbc and the service. */
		public Payments(JdbcTemplate jdbc, Charges charges) {
			this.jdbc = jdbc;
			this.charges = charges;
		}

		/** {"amount": N, "delay_ms": D, "fail": true, "throw": true}: 201 {"charge": id} through JdbcTemplate. */
		@PostMapping("/payments")
		public ResponseEntity<Map<String, Long>> pay(@RequestBody Map<String, Object> body, HttpServletRequest req)
				throws InterruptedException {
			RUNS.incrementAndGet();
			Thread.sleep(((Number) body.getOrDefault("delay_ms", 0)).longValue());
			long id = jdbc.queryForObject("INSERT INTO spring_charges (amount) VALUES (?) RETURNING id", Long.class,
					((Number) body.get("amount")).longValue());
			if (Boolean.TRUE.equals(body.get("throw"))) {
				throw new IllegalStateException("the handler failed");
			}
			if (req.getAttribute(IdempotencyFilter.CONNECTION) == null) {
				throw new IllegalStateException("no transaction from the filter");
			}
			return ResponseEntity.status(Boolean.TRUE.equals(body.get("fail")) ? 500 : 201).body(Map.of("charge", id));
		}

		/** The same through the @Transactional service. */
		@PostMapping("/service-payments")
		public ResponseEntity<Map<String, Long>> payThroughService(@RequestBody Map<String, Object> body) {
			RUNS.incrementAndGet();
			long id = charges.charge(((Number) body.get("amount")).longValue());
			if (Boolean.TRUE.equals(body.get("throw"))) {
				throw new IllegalStateException("the handler failed after the service committed nothing yet");
			}
			return ResponseEntity.status(201).body(Map.of("charge", id));
		}

		/**
		 * Records its transaction's id, and registers a before-commit callback (as an outbox or a
		 * BEFORE_COMMIT event listener does) that records the id of the transaction it runs in.
		 */
		@PostMapping("/outbox-payments")
		public ResponseEntity<Map<String, Long>> payWithOutbox(@RequestBody Map<String, Object> body) {
			String marker = String.valueOf(body.get("marker"));
			jdbc.update("INSERT INTO spring_outbox (marker, kind, xid) VALUES (?, 'handler', pg_current_xact_id()::text)",
					marker);
			TransactionSynchronizationManager.registerSynchronization(new TransactionSynchronization() {
				@Override
				public void beforeCommit(boolean readOnly) {
					jdbc.update("INSERT INTO spring_outbox (marker, kind, xid)"
							+ " VALUES (?, 'before_commit', pg_current_xact_id()::text)", marker);
				}
			});
			return ResponseEntity.status(201).body(Map.of("charge", 0L));
		}

		/** An asynchronous handler: refused behind the filter. */
		@PostMapping("/async-payments")
		public Callable<Map<String, Long>> payLater(@RequestBody Map<String, Object> body) {
			RUNS.incrementAndGet();
			jdbc.update("INSERT INTO spring_charges (amount) VALUES (?)", ((Number) body.get("amount")).longValue());
			return () -> Map.of("charge", jdbc.queryForObject(
					"INSERT INTO spring_charges (amount) VALUES (?) RETURNING id", Long.class,
					((Number) body.get("amount")).longValue()));
		}
	}
}
