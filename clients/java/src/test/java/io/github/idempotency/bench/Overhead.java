package io.github.idempotency.bench;

import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.TestDb;
import io.github.idempotency.servlet.IdempotencyFilter;
import io.github.idempotency.servlet.IdempotencyOptions;
import io.github.idempotency.servlet.JdbcRequestTransactions;
import io.github.idempotency.servlet.PaymentServlet;
import io.github.idempotency.servlet.RecipeFilter;
import io.github.idempotency.servlet.RequestTransactions;
import io.github.idempotency.servlet.TomcatServer;
import jakarta.servlet.Filter;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.UUID;

/**
 * The filter's overhead: the payment handler behind the filter in each of its modes (two transactions,
 * one transaction), under the hand-written recipe ({@link RecipeFilter}), and without any in a
 * transaction of its own (BEGIN, insert, COMMIT, as the filter gives it), each in an embedded Tomcat
 * on 127.0.0.1 with a HikariCP pool whose connections count round trips. One client sends sequential
 * requests over a kept-alive connection; the kinds take turns, 100 timed requests at a time after 20
 * untimed. Prints the median latency and the round trips per request of each kind, and the speed of
 * each mode against the recipe (the recipe's median over the mode's: above 1.0x, the filter is faster).
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
		TestDb.sql(RecipeFilter.TABLE);
		try (HikariDataSource guardedPool = pool("guarded", syncCommit);
				HikariDataSource onePool = pool("one", syncCommit);
				HikariDataSource recipePool = pool("recipe", syncCommit);
				HikariDataSource plainPool = pool("plain", syncCommit);
				TomcatServer guarded = guarded(guardedPool, false);
				TomcatServer one = guarded(onePool, true);
				TomcatServer recipe = new TomcatServer(new PaymentServlet("bench_charges"), new RecipeFilter(recipePool));
				TomcatServer plain = new TomcatServer(new PaymentServlet("bench_charges"), inTransaction(plainPool))) {
			HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
			Map<String, Kind> kinds = new LinkedHashMap<>();
			kinds.put("plain", new Kind(plain.port(), "plain", () -> null));
			for (Map.Entry<String, TomcatServer> server : Map.of("guarded", guarded, "one", one, "recipe", recipe)
					.entrySet()) {
				String mode = server.getKey();
				String replayKey = UUID.randomUUID().toString();
				kinds.put(mode + " fresh", new Kind(server.getValue().port(), mode, () -> UUID.randomUUID().toString()));
				kinds.put(mode + " replay", new Kind(server.getValue().port(), mode, () -> replayKey));
			}
			for (Kind k : kinds.values()) {
				k.send(http, 20, false);
			}
			for (int done = 0; done < total; done += 100) {
				for (Kind k : kinds.values()) {
					k.send(http, 20, false);
					k.send(http, 100, true);
				}
			}
			System.out.printf("synchronous_commit=%s, %d requests of each kind"
					+ " (guarded: two transactions; one: one transaction; recipe: hand-written)%n", syncCommit, total);
			for (String name : List.of("plain", "guarded fresh", "guarded replay", "one fresh", "one replay",
					"recipe fresh", "recipe replay")) {
				Kind k = kinds.get(name);
				System.out.printf("%-15s median %.3f ms, %.2f round trips a request%n", name, k.median(),
						(double) k.roundTrips / k.timed.size());
			}
			System.out.println("ours / hand-written (the recipe's median over ours; above 1.0x ours is faster):");
			for (String mode : List.of("guarded", "one")) {
				System.out.printf("%-8s fresh %.2fx, replay %.2fx%n", mode,
						kinds.get("recipe fresh").median() / kinds.get(mode + " fresh").median(),
						kinds.get("recipe replay").median() / kinds.get(mode + " replay").median());
			}
		}
	}

	/** The handler behind the filter, in one-transaction mode or not. */
	private static TomcatServer guarded(HikariDataSource pool, boolean oneTransaction) throws Exception {
		return new TomcatServer(new PaymentServlet("bench_charges"), new IdempotencyFilter(pool,
				new JdbcRequestTransactions(pool), new IdempotencyOptions().oneTransaction(oneTransaction)));
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
