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
import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.file.Files;
import java.nio.file.Path;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;

/**
 * The filter's overhead: the payment handler behind the filter in each of its modes (two transactions,
 * one transaction), each with its statements unnamed (the default) and prepared (the prepare option),
 * under the hand-written recipe ({@link RecipeFilter}), and without any in a
 * transaction of its own (BEGIN, insert, COMMIT, as the filter gives it), each in an embedded Tomcat
 * on 127.0.0.1 with a HikariCP pool whose connections count round trips. One client sends sequential
 * requests over a kept-alive connection; the kinds take turns, 100 timed requests at a time after 20
 * untimed. Prints the median latency, the round trips and the CPU per request of each kind (the
 * request threads' in the app, the pool's backends' from /proc/PID/schedstat when the server runs on
 * this machine), and the speed of each mode against the recipe (the recipe's median over the mode's:
 * above 1.0x, the filter is faster). CPU time varies less than latency on a loaded machine.
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
		try (Connection monitor = TestDb.connect();
				HikariDataSource guardedPool = pool("guarded", syncCommit);
				HikariDataSource onePool = pool("one", syncCommit);
				HikariDataSource guardedPreparedPool = pool("guarded_prepare", syncCommit);
				HikariDataSource onePreparedPool = pool("one_prepare", syncCommit);
				HikariDataSource recipePool = pool("recipe", syncCommit);
				HikariDataSource plainPool = pool("plain", syncCommit);
				TomcatServer guarded = guarded(guardedPool, false, false);
				TomcatServer one = guarded(onePool, true, false);
				TomcatServer guardedPrepared = guarded(guardedPreparedPool, false, true);
				TomcatServer onePrepared = guarded(onePreparedPool, true, true);
				TomcatServer recipe = server("recipe", new RecipeFilter(recipePool));
				TomcatServer plain = server("plain", inTransaction(plainPool))) {
			HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
			Map<String, Kind> kinds = new LinkedHashMap<>();
			kinds.put("plain", new Kind(monitor, plain.port(), "plain", () -> null));
			for (Map.Entry<String, TomcatServer> server : Map.of("guarded", guarded, "one", one, "guarded_prepare",
					guardedPrepared, "one_prepare", onePrepared, "recipe", recipe).entrySet()) {
				String mode = server.getKey();
				String replayKey = UUID.randomUUID().toString();
				kinds.put(mode + " fresh", new Kind(monitor, server.getValue().port(), mode, () -> UUID.randomUUID().toString()));
				kinds.put(mode + " replay", new Kind(monitor, server.getValue().port(), mode, () -> replayKey));
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
					+ " (guarded: two transactions; one: one transaction; _prepare: the prepare option;"
					+ " recipe: hand-written)%n", syncCommit, total);
			List<String> modes = List.of("guarded", "one", "guarded_prepare", "one_prepare");
			List<String> names = new ArrayList<>(List.of("plain"));
			for (String mode : modes) {
				names.addAll(List.of(mode + " fresh", mode + " replay"));
			}
			names.addAll(List.of("recipe fresh", "recipe replay"));
			for (String name : names) {
				Kind k = kinds.get(name);
				System.out.printf("%-23s median %.3f ms, %.2f round trips, CPU %s a request%n", name, k.median(),
						(double) k.roundTrips / k.timed.size(), k.cpu());
			}
			System.out.println("ours / hand-written (the recipe's median over ours; above 1.0x ours is faster):");
			for (String mode : modes) {
				System.out.printf("%-16s fresh %.2fx, replay %.2fx%n", mode,
						kinds.get("recipe fresh").median() / kinds.get(mode + " fresh").median(),
						kinds.get("recipe replay").median() / kinds.get(mode + " replay").median());
			}
		}
	}

	/** The handler behind the filter, in one-transaction mode or not, with the prepare option or not. */
	private static TomcatServer guarded(HikariDataSource pool, boolean oneTransaction, boolean prepare)
			throws Exception {
		return server(pool.getPoolName(), new IdempotencyFilter(pool, new JdbcRequestTransactions(pool),
				new IdempotencyOptions().oneTransaction(oneTransaction).prepare(prepare)));
	}

	/** The request threads' CPU time so far, in ns, per pool name. */
	private static final Map<String, AtomicLong> APP_CPU = new ConcurrentHashMap<>();

	/** The payment handler behind filter, the request threads' CPU time counted under name. */
	private static TomcatServer server(String name, Filter filter) throws Exception {
		ThreadMXBean threads = ManagementFactory.getThreadMXBean();
		AtomicLong cpu = APP_CPU.computeIfAbsent(name, n -> new AtomicLong());
		Filter counting = (req, res, chain) -> {
			long before = threads.getCurrentThreadCpuTime();
			try {
				chain.doFilter(req, res);
			} finally {
				cpu.addAndGet(threads.getCurrentThreadCpuTime() - before);
			}
		};
		return new TomcatServer(new PaymentServlet("bench_charges"), counting, filter);
	}

	/**
	 * The CPU time so far, in ns, of the backends of the pool name (application_name), from
	 * /proc/PID/schedstat; -1 when the server is not on this machine.
	 */
	private static long backendCpu(Connection monitor, String name) throws SQLException {
		long sum = 0;
		try (PreparedStatement st = monitor.prepareStatement(
				"SELECT pid FROM pg_stat_activity WHERE application_name = ?")) {
			st.setString(1, name);
			try (ResultSet rs = st.executeQuery()) {
				while (rs.next()) {
					Path stat = Path.of("/proc", Integer.toString(rs.getInt(1)), "schedstat");
					try {
						sum += Long.parseLong(Files.readString(stat).split(" ")[0]);
					} catch (IOException | RuntimeException e) {
						return -1;
					}
				}
			}
		}
		return sum;
	}

	/** A kind of request: its server, its pool's name (round trips, CPU), the key it sends. */
	private static final class Kind {
		final Connection monitor;
		final int port;
		final String counter;
		final java.util.function.Supplier<String> key;
		final List<Double> timed = new ArrayList<>();
		long roundTrips;
		long appNs;
		long backendNs;

		Kind(Connection monitor, int port, String counter, java.util.function.Supplier<String> key) {
			this.monitor = monitor;
			this.port = port;
			this.counter = counter;
			this.key = key;
		}

		void send(HttpClient http, int n, boolean time) throws Exception {
			long app = APP_CPU.get(counter).get();
			long backend = time ? backendCpu(monitor, counter) : 0;
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
			if (time) {
				appNs += APP_CPU.get(counter).get() - app;
				long after = backendCpu(monitor, counter);
				backendNs = backend < 0 || after < 0 || backendNs < 0 ? -1 : backendNs + after - backend;
			}
		}

		/** The CPU per timed request: the app's request threads and the backends. */
		String cpu() {
			return String.format("%.0f µs app + %s backend", appNs / 1e3 / timed.size(),
					backendNs < 0 ? "n/a" : String.format("%.0f µs", backendNs / 1e3 / timed.size()));
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
				+ "&ApplicationName=" + name + "&options=-c%20synchronous_commit%3D" + syncCommit);
		config.setPoolName(name);
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
