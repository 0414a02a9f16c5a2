package example.jobs;

import com.github.kagkarlsson.scheduler.Scheduler;
import com.github.kagkarlsson.scheduler.SchedulerClient;
import com.github.kagkarlsson.scheduler.task.helper.OneTimeTask;
import com.github.kagkarlsson.scheduler.task.helper.Tasks;
import io.github.idempotency.function.FunctionOptions;
import io.github.idempotency.function.IdempotentFunction;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.time.Duration;
import java.time.Instant;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import javax.sql.DataSource;

/**
 * The redelivery storm: ORDERS units of work, each scheduled DELIVERIES times (as the same task
 * delivered again and again), worked on by WORKERS threads at once; the task wrapped in the idempotent
 * function keyed by the order ("once": each effect once) or the bare handler ("bare": every delivery an
 * effect). Prints jobs per second and the effects per order.
 */
final class Storm {
	static final int ORDERS = 100;
	static final int DELIVERIES = 20;
	static final int WORKERS = 8;

	private Storm() {
	}

	/** Runs the storm in mode "once" or "bare". */
	static void run(DataSource ds, String mode) throws Exception {
		if (!mode.equals("once") && !mode.equals("bare")) {
			throw new IllegalArgumentException("storm once | bare");
		}
		Jobs.createTables(ds);
		String queue = "storm-" + mode + "-" + System.currentTimeMillis();
		try (Connection c = ds.getConnection(); Statement st = c.createStatement()) {
			st.execute("CREATE TABLE IF NOT EXISTS storm_effects (order_id int NOT NULL, mode text NOT NULL, queue text NOT NULL)");
		}
		int total = ORDERS * DELIVERIES;
		CountDownLatch done = new CountDownLatch(total);
		OneTimeTask<Integer> task = Tasks.oneTime(queue, Integer.class).execute((instance, context) -> {
			try {
				if (mode.equals("once")) {
					IdempotentFunction.run(ds, queue + ":" + instance.getData(),
							FunctionOptions.of(Integer.class).scope("storm").waitFor(Duration.ofSeconds(30)),
							tx -> effect(tx, instance.getData(), mode, queue));
				} else {
					bare(ds, instance.getData(), mode, queue);
				}
			} catch (RuntimeException e) {
				throw e;
			} catch (Exception e) {
				throw new IllegalStateException(e);
			}
			done.countDown();
		});
		SchedulerClient client = SchedulerClient.Builder.create(ds, task).build();
		for (int d = 0; d < DELIVERIES; d++) {
			for (int order = 0; order < ORDERS; order++) {
				client.scheduleIfNotExists(task.instance(d + "-" + order, order), Instant.now());
			}
		}
		Scheduler scheduler = Scheduler.create(ds, task).threads(WORKERS).pollingInterval(Duration.ofMillis(100))
				.pollUsingLockAndFetch(0.5, 1.0).build();
		long started = System.nanoTime();
		scheduler.start();
		if (!done.await(10, TimeUnit.MINUTES)) {
			throw new IllegalStateException("the storm did not finish");
		}
		double seconds = (System.nanoTime() - started) / 1e9;
		scheduler.stop();
		try (Connection c = ds.getConnection(); PreparedStatement st = c.prepareStatement(
				"SELECT sum(n)::int, count(*)::int, max(n)::int FROM (SELECT order_id, count(*) AS n FROM storm_effects"
						+ " WHERE queue = ? GROUP BY order_id) AS o")) {
			st.setString(1, queue);
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				System.out.printf("%s: %d jobs (%d orders x %d) over %d workers: %.0f jobs/s; %d effects on %d orders, "
						+ "at most %d per order%n", mode, total, ORDERS, DELIVERIES, WORKERS, total / seconds,
						rs.getInt(1), rs.getInt(2), rs.getInt(3));
			}
		}
	}

	/** The effect: a row per order run. */
	static Integer effect(Connection tx, int order, String mode, String queue) throws SQLException {
		try (PreparedStatement st = tx.prepareStatement("INSERT INTO storm_effects VALUES (?, ?, ?)")) {
			st.setInt(1, order);
			st.setString(2, mode);
			st.setString(3, queue);
			st.executeUpdate();
		}
		return order;
	}

	/** The bare handler: the effect in a transaction of its own. */
	static void bare(DataSource ds, int order, String mode, String queue) throws SQLException {
		try (Connection c = ds.getConnection()) {
			c.setAutoCommit(false);
			effect(c, order, mode, queue);
			c.commit();
			c.setAutoCommit(true);
		}
	}
}
