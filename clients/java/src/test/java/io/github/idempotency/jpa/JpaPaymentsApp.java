package io.github.idempotency.jpa;

import io.github.idempotency.TestDb;
import java.sql.SQLException;
import java.util.Map;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.http.ResponseEntity;
import org.springframework.web.bind.annotation.PostMapping;
import org.springframework.web.bind.annotation.RequestBody;
import org.springframework.web.bind.annotation.RestController;

/**
 * A Spring Boot app that writes through Spring Data JPA (Hibernate): its repository's writes wait in the
 * persistence context until the transaction manager flushes them, after the handler has answered.
 */
@SpringBootApplication
public class JpaPaymentsApp {

	/** The route. */
	@RestController
	public static class Payments {
		private final Charges charges;

		/** On the repository. */
		public Payments(Charges charges) {
			this.charges = charges;
		}

		/**
		 * {"amount": N, "reference": R, "throw": true, "stolen": true}: saves a charge and answers 201
		 * {"charge": id}; throw: flushes, then fails; stolen: the claim goes while the handler runs (as
		 * if a retry took it over).
		 */
		@PostMapping("/payments")
		public ResponseEntity<Map<String, Long>> pay(@RequestBody Map<String, Object> body) throws SQLException {
			Charge charge = charges.save(new Charge(((Number) body.get("amount")).longValue(),
					(String) body.get("reference")));
			if (Boolean.TRUE.equals(body.get("throw"))) {
				charges.flush(); // the INSERT reaches the database: the rollback must undo it
				throw new IllegalStateException("the handler failed");
			}
			if (Boolean.TRUE.equals(body.get("stolen"))) {
				TestDb.sql("DELETE FROM idempotency.keys WHERE key = '" + body.get("key") + "'");
			}
			return ResponseEntity.status(201).body(Map.of("charge", charge.id()));
		}
	}
}
