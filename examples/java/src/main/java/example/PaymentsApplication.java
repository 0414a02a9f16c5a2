package example;

import com.standardwebhooks.Webhook;
import io.github.idempotency.PostgresUrl;
import io.github.idempotency.servlet.IdempotencyFilter;
import io.github.idempotency.servlet.IdempotencyOptions;
import io.github.idempotency.servlet.Webhooks;
import io.github.idempotency.spring.SpringRequestTransactions;
import jakarta.servlet.DispatcherType;
import javax.sql.DataSource;
import org.springframework.boot.autoconfigure.condition.ConditionalOnExpression;
import org.springframework.boot.web.servlet.FilterRegistrationBean;
import org.springframework.context.annotation.Bean;
import org.springframework.transaction.PlatformTransactionManager;
import java.math.BigDecimal;
import java.time.Duration;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.http.ResponseEntity;
import org.springframework.jdbc.core.JdbcTemplate;
import org.springframework.web.bind.annotation.GetMapping;
import org.springframework.web.bind.annotation.PostMapping;
import org.springframework.web.bind.annotation.RequestBody;
import org.springframework.web.bind.annotation.RestController;

/**
 * The examples' payment API (docs/http-contract.md, "The example apps") on Spring Boot. The
 * idempotency filter comes from pg-idempotency's auto-configuration; the handler writes with
 * JdbcTemplate, in the transaction the filter opened, which commits with the stored response.
 * Environment: DATABASE_URL (a libpq URI, a Unix-socket directory too: {@code ?host=/run/postgresql}),
 * PORT, IDEMPOTENCY_LEASE ("1 second"; unset: the database's {@code idempotency.lease}),
 * IDEMPOTENCY_FAIL_OPEN=on, IDEMPOTENCY_ONE_TRANSACTION=on (the claim in the charge's transaction),
 * WEBHOOK_SECRET ("whsec_..."): also serve POST /webhooks, a Standard Webhooks receiver.
 */
@SpringBootApplication
public class PaymentsApplication {

	/** Starts the app with the environment turned into Spring properties. */
	public static void main(String[] args) {
		// System properties: Spring would otherwise bind IDEMPOTENCY_LEASE itself, and not read "1 second".
		System.setProperty("spring.datasource.url",
				PostgresUrl.toJdbc(env("DATABASE_URL", "postgresql://localhost/postgres")));
		System.setProperty("server.port", env("PORT", "3000"));
		String lease = env("IDEMPOTENCY_LEASE", null);
		if (lease != null) {
			System.setProperty("idempotency.lease", seconds(lease).toMillis() + "ms");
		}
		System.setProperty("idempotency.fail-open", Boolean.toString("on".equals(System.getenv("IDEMPOTENCY_FAIL_OPEN"))));
		System.setProperty("idempotency.one-transaction",
				Boolean.toString("on".equals(System.getenv("IDEMPOTENCY_ONE_TRANSACTION"))));
		System.setProperty("idempotency.url-patterns", "/payments");
		SpringApplication.run(PaymentsApplication.class, args);
	}

	/**
	 * POST /webhooks, when WEBHOOK_SECRET is set: a second filter, verifying each delivery with
	 * standardwebhooks before its claim, keyed by webhook-id, scoped by the sender.
	 */
	@Bean
	@ConditionalOnExpression("'${WEBHOOK_SECRET:}' != ''")
	FilterRegistrationBean<IdempotencyFilter> webhookFilter(DataSource dataSource,
			PlatformTransactionManager transactionManager) throws Exception {
		IdempotencyOptions options = Webhooks.standard(new IdempotencyOptions(),
				new Webhook(System.getenv("WEBHOOK_SECRET")), "standard-webhooks")
				.oneTransaction("on".equals(System.getenv("IDEMPOTENCY_ONE_TRANSACTION")));
		String lease = env("IDEMPOTENCY_LEASE", null);
		if (lease != null) {
			options.lease(seconds(lease));
		}
		FilterRegistrationBean<IdempotencyFilter> registration = new FilterRegistrationBean<>(new IdempotencyFilter(
				dataSource, new SpringRequestTransactions(transactionManager, dataSource), options));
		registration.setName("webhookIdempotencyFilter");
		registration.setDispatcherTypes(DispatcherType.REQUEST);
		registration.setUrlPatterns(java.util.List.of("/webhooks"));
		return registration;
	}

	/** The routes. */
	@RestController
	static class Payments {
		private final JdbcTemplate jdbc;

		Payments(JdbcTemplate jdbc) {
			this.jdbc = jdbc;
			jdbc.execute("CREATE TABLE IF NOT EXISTS charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
					+ " amount numeric NOT NULL, created_at timestamptz DEFAULT now())");
		}

		@GetMapping("/")
		Map<String, String> health() {
			return Map.of("status", "ok");
		}

		/** {"amount": N, "delay_ms": D, "fail": true}: 201 {"charge": id}. */
		@PostMapping("/payments")
		ResponseEntity<Map<String, Object>> pay(@RequestBody Map<String, Object> body) throws InterruptedException {
			if (!(body.get("amount") instanceof Number n) || new BigDecimal(n.toString()).signum() <= 0) {
				return ResponseEntity.badRequest().body(Map.of("error", "amount must be a number above 0"));
			}
			if (body.get("delay_ms") instanceof Number delay) {
				Thread.sleep(delay.longValue());
			}
			Long id = jdbc.queryForObject("INSERT INTO charges (amount) VALUES (?) RETURNING id", Long.class,
					new BigDecimal(n.toString()));
			if (Boolean.TRUE.equals(body.get("fail"))) {
				return ResponseEntity.status(500).body(Map.of("error", "card declined", "charge", id));
			}
			return ResponseEntity.status(201).body(Map.of("charge", id));
		}
	}

	/** A Standard Webhooks event: charges its data.amount (after data.delay_ms) and answers 200 {"charge": id}. */
	@RestController
	static class WebhookReceiver {
		private final JdbcTemplate jdbc;

		WebhookReceiver(JdbcTemplate jdbc) {
			this.jdbc = jdbc;
		}

		@PostMapping("/webhooks")
		ResponseEntity<Map<String, Object>> receive(@RequestBody Map<String, Object> event) throws InterruptedException {
			if (System.getenv("WEBHOOK_SECRET") == null || System.getenv("WEBHOOK_SECRET").isEmpty()) {
				return ResponseEntity.status(404).build();
			}
			if (!(event.get("data") instanceof Map<?, ?> data) || !(data.get("amount") instanceof Number n)
					|| new BigDecimal(n.toString()).signum() <= 0) {
				return ResponseEntity.badRequest().body(Map.of("error", "data.amount must be a number above 0"));
			}
			if (data.get("delay_ms") instanceof Number delay) {
				Thread.sleep(delay.longValue());
			}
			Long id = jdbc.queryForObject("INSERT INTO charges (amount) VALUES (?) RETURNING id", Long.class,
					new BigDecimal(n.toString()));
			return ResponseEntity.ok(Map.of("charge", id));
		}
	}

	/** An environment variable, or a default. */
	private static String env(String name, String otherwise) {
		String value = System.getenv(name);
		return value == null || value.isEmpty() ? otherwise : value;
	}

	/** A PostgreSQL interval of seconds, minutes or milliseconds ("1 second", "60 seconds", "500 ms"). */
	static Duration seconds(String interval) {
		Matcher m = Pattern.compile("\\s*(\\d+)\\s*(ms|milliseconds?|s|secs?|seconds?|min|mins|minutes?)?\\s*")
				.matcher(interval);
		if (!m.matches()) {
			throw new IllegalArgumentException("IDEMPOTENCY_LEASE: not an interval this app reads: " + interval);
		}
		long n = Long.parseLong(m.group(1));
		String unit = m.group(2) == null ? "s" : m.group(2);
		return unit.startsWith("m") && !unit.startsWith("mi") ? Duration.ofMillis(n)
				: unit.startsWith("mi") ? Duration.ofMinutes(n) : Duration.ofSeconds(n);
	}
}
