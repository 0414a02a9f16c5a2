package io.github.idempotency.bench;

import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.IdempotencyFilter;
import io.github.idempotency.servlet.IdempotencyOptions;
import io.github.idempotency.servlet.JdbcRequestTransactions;
import io.github.idempotency.servlet.PaymentServlet;
import io.github.idempotency.servlet.RequestTransactions;
import io.github.idempotency.servlet.TomcatServer;
import jakarta.servlet.Filter;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.UUID;

/**
 * The filter's overhead: the payment handler behind the filter, and the same handler without it in a
 * transaction of its own (BEGIN, insert, COMMIT, as the filter gives it), each in an embedded Tomcat
 * on 127.0.0.1 with a HikariCP pool whose connections count round trips. One client sends sequential
 * requests over a kept-alive connection; the kinds take turns, 100 timed requests at a time after 20
 * untimed. Prints the median latency and the round trips per request of each kind.
 * IDEMPOTENCY_ONE_TRANSACTION=on measures the filter in one-transaction mode.
 *   java ... io.github.idempotency.bench.Overhead [requests per kind] [synchronous_commit]
 */
public final class Overhead {
	private Overhead() {
	}

	/** Runs the benchmark. */
	public static void main(String[] args) throws Exception {
		int total = args.length > 0 ? Integer.parseInt(args[0]) : 2000;
		String syncCommit = args.length > 1 ? args[1] : "on";
		TestDb.sql("CREATE TABLE IF NOT EXISTS bench_charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
				+ " amount numeric NOT NULL)");
		try (HikariDataSource guardedPool = pool("guarded", syncCommit);
				HikariDataSource plainPool = pool("plain", syncCommit);
				TomcatServer guarded = new TomcatServer(new PaymentServlet("bench_charges"),
						new IdempotencyFilter(guardedPool, new JdbcRequestTransactions(guardedPool), new IdempotencyOptions()
								.oneTransaction("on".equals(System.getenv("IDEMPOTENCY_ONE_TRANSACTION")))));
				TomcatServer plain = new TomcatServer(new PaymentServlet("bench_charges"), inTransaction(plainPool))) {
			HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
			String replayKey = UUID.randomUUID().toString();
			Map<String, Kind> kinds = Map.of(
					"plain", new Kind(plain.port(), "plain", () -> null),
					"fresh", new Kind(guarded.port(), "guarded", () -> UUID.randomUUID().toString()),
					"replay", new Kind(guarded.port(), "guarded", () -> replayKey));
			for (String name : List.of("plain", "fresh", "replay")) {
				kinds.get(name).send(http, 20, false);
			}
			for (int done = 0; done < total; done += 100) {
				for (String name : List.of("plain", "fresh", "replay")) {
					kinds.get(name).send(http, 20, false);
					kinds.get(name).send(http, 100, true);
				}
			}
			System.out.printf("synchronous_commit=%s, one transaction %s, %d requests of each kind%n", syncCommit,
					System.getenv().getOrDefault("IDEMPOTENCY_ONE_TRANSACTION", "off"), total);
			for (String name : List.of("plain", "fresh", "replay")) {
				Kind k = kinds.get(name);
				System.out.printf("%-7s median %.3f ms, %.2f round trips a request%n", name, k.median(),
						(double) k.roundTrips / k.timed.size());
			}
		}
	}

	/** A kind of request: its server, its pool's round-trip counter, the key it sends. */
	private static final class Kind {
		final int port;
		final String counter;
		final java.util.function.Supplier<String> key;
		final List<Double> timed = new ArrayList<>();
		long roundTrips;

		Kind(int port, String counter, java.util.function.Supplier<String> key) {
			this.port = port;
			this.counter = counter;
			this.key = key;
		}

		void send(HttpClient http, int n, boolean time) throws Exception {
			for (int i = 0; i < n; i++) {
				HttpRequest.Builder req = HttpRequest.newBuilder(URI.create("http://127.0.0.1:" + port + "/payments"))
						.header("Authorization", "Bearer bench").header("Content-Type", "application/json")
						.POST(HttpRequest.BodyPublishers.ofString("{\"amount\":1}"));
				String k = key.get();
				if (k != null) {
					req.header("Idempotency-Key", k);
				}
				long before = CountingSocketFactory.ROUND_TRIPS.get(counter).get();
				long start = System.nanoTime();
				HttpResponse<byte[]> r = http.send(req.build(), HttpResponse.BodyHandlers.ofByteArray());
				long elapsed = System.nanoTime() - start;
				if (r.statusCode() != 201) {
					throw new IllegalStateException("status " + r.statusCode());
				}
				if (time) {
					timed.add(elapsed / 1e6);
					roundTrips += CountingSocketFactory.ROUND_TRIPS.get(counter).get() - before;
				}
			}
		}

		double median() {
			List<Double> sorted = new ArrayList<>(timed);
			Collections.sort(sorted);
			return sorted.get(sorted.size() / 2);
		}
	}

	/** A pool of 2 whose connections count round trips under name. */
	private static HikariDataSource pool(String name, String syncCommit) {
		HikariConfig config = new HikariConfig();
		config.setJdbcUrl(TestDb.url() + (TestDb.url().contains("?") ? "&" : "?")
				+ "sslmode=disable&socketFactory=" + CountingSocketFactory.class.getName() + "&socketFactoryArg=" + name
				+ "&options=-c%20synchronous_commit%3D" + syncCommit);
		config.setMaximumPoolSize(2);
		CountingSocketFactory.ROUND_TRIPS.computeIfAbsent(name, n -> new java.util.concurrent.atomic.AtomicLong());
		return new HikariDataSource(config);
	}

	/** The same handler without the filter: a transaction of its own per request, as the filter gives it. */
	private static Filter inTransaction(HikariDataSource ds) {
		RequestTransactions transactions = new JdbcRequestTransactions(ds);
		return (req, res, chain) -> {
			try {
				RequestTransactions.RequestTransaction tx = transactions.begin();
				req.setAttribute(IdempotencyFilter.CONNECTION, tx.connection());
				chain.doFilter(req, res);
				tx.commit();
			} catch (Exception e) {
				throw new jakarta.servlet.ServletException(e);
			}
		};
	}
}
