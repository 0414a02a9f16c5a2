package example.jobs;

import com.github.kagkarlsson.scheduler.Scheduler;
import com.github.kagkarlsson.scheduler.SchedulerClient;
import com.github.kagkarlsson.scheduler.task.helper.OneTimeTask;
import com.github.kagkarlsson.scheduler.task.helper.Tasks;
import com.zaxxer.hikari.HikariConfig;
import com.zaxxer.hikari.HikariDataSource;
import io.github.idempotency.Idempotency;
import io.github.idempotency.KeyRecord;
import io.github.idempotency.PostgresUrl;
import io.github.idempotency.function.FunctionOptions;
import io.github.idempotency.function.IdempotentFunction;
import io.github.idempotency.servlet.JdbcRequestTransactions;
import io.github.idempotency.servlet.RequestTransactions;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.Optional;
import java.util.UUID;
import java.util.concurrent.CountDownLatch;
import javax.sql.DataSource;

/**
 * Jobs that run once however often the queue delivers them: a db-scheduler one-time task "charge" on the
 * application's database, which charges its amount into the same charges table as the example apps'
 * POST /payments. The task is an idempotent function of pg-idempotency keyed by its instance id: a task
 * delivered again (its worker died after its work committed, before db-scheduler removed the execution)
 * gets the stored result, and nothing is charged again.
 *
 * <pre>
 *   ./run worker            works on the queue until SIGTERM
 *   ./run enqueue AMOUNT    schedules a task; prints its id
 *   ./run status ID         prints the task's state and output (JSON)
 *   ./run storm [once|bare] the redelivery storm: jobs per second, effects
 * </pre>
 *
 * Environment: DATABASE_URL; JOBS_EXPIRE_SECONDS (default 60: how long a worker may miss its heartbeats
 * before db-scheduler takes its execution for dead and runs it again); JOBS_ACK=transaction
 * (db-scheduler's removal of the execution commits with the task's work: {@link AckInTransaction});
 * for the tests, JOBS_CRASH=mid-job (the worker kills itself after writing the charge, before its
 * transaction commits) or after-commit (after the work committed, before db-scheduler's acknowledgment).
 */
public final class Jobs {
	static final String TASK = "charge";
	static final String SCOPE = "db-scheduler:" + TASK;

	private Jobs() {
	}

	/** What a charge returns, stored and given back to a redelivery. */
	public record Charged(long charge) {
	}

	public static void main(String[] args) throws Exception {
		String command = args.length > 0 ? args[0] : "";
		try (HikariDataSource pool = pool()) {
			switch (command) {
				case "worker" -> worker(pool);
				case "enqueue" -> System.out.println(enqueue(pool, Integer.parseInt(args[1])));
				case "status" -> System.out.println(status(pool, args[1]));
				case "storm" -> Storm.run(pool, args.length > 1 ? args[1] : "once");
				default -> {
					System.err.println("usage: run worker | enqueue AMOUNT | status ID | storm [once | bare]");
					System.exit(2);
				}
			}
		}
	}

	/** A pool on DATABASE_URL. */
	static HikariDataSource pool() {
		HikariConfig config = new HikariConfig();
		config.setJdbcUrl(PostgresUrl.toJdbc(System.getenv().getOrDefault("DATABASE_URL", "postgresql://localhost/postgres")));
		config.setMaximumPoolSize(20);
		config.setConnectionTimeout(10_000);
		return new HikariDataSource(config);
	}

	/**
	 * Creates db-scheduler's table (its documented PostgreSQL schema) and the charges table, if absent.
	 */
	static void createTables(DataSource ds) throws SQLException {
		try (Connection c = ds.getConnection(); Statement st = c.createStatement()) {
			st.execute("CREATE TABLE IF NOT EXISTS scheduled_tasks ("
					+ " task_name text NOT NULL, task_instance text NOT NULL, task_data bytea,"
					+ " execution_time timestamptz NOT NULL, picked boolean NOT NULL, picked_by text,"
					+ " last_success timestamptz, last_failure timestamptz, consecutive_failures int,"
					+ " last_heartbeat timestamptz, version bigint NOT NULL, priority smallint,"
					+ " PRIMARY KEY (task_name, task_instance))");
			st.execute("CREATE INDEX IF NOT EXISTS scheduled_tasks_execution_time ON scheduled_tasks (execution_time)");
			st.execute("CREATE INDEX IF NOT EXISTS scheduled_tasks_last_heartbeat ON scheduled_tasks (last_heartbeat)");
			st.execute("CREATE TABLE IF NOT EXISTS charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
					+ " amount numeric NOT NULL, created_at timestamptz DEFAULT now())");
		}
	}

	/**
	 * The task: charges its amount once per task instance, its writes and its result committed together
	 * (one transaction); a delivery of a task that already ran gets that result back without running.
	 */
	static OneTimeTask<Integer> chargeTask(DataSource ds, RequestTransactions transactions) {
		return Tasks.oneTime(TASK, Integer.class).execute((instance, context) -> {
			try {
				IdempotentFunction.run(ds, transactions, instance.getId(),
						FunctionOptions.of(Charged.class).scope(SCOPE).args(instance.getData()),
						tx -> charge(tx, instance.getData()));
			} catch (RuntimeException e) {
				throw e;
			} catch (Exception e) {
				throw new IllegalStateException(e);
			}
			if ("after-commit".equals(System.getenv("JOBS_CRASH")) && !AckInTransaction.on()) {
				crash("after-commit: the charge committed, not acknowledged");
			}
		});
	}

	/** Writes the charge in tx. */
	static Charged charge(Connection tx, int amount) throws SQLException {
		try (PreparedStatement st = tx.prepareStatement("INSERT INTO charges (amount) VALUES (?) RETURNING id")) {
			st.setInt(1, amount);
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				if ("mid-job".equals(System.getenv("JOBS_CRASH"))) {
					crash("mid-job: the charge is written, not committed");
				}
				return new Charged(rs.getLong(1));
			}
		}
	}

	/** Ends the process at once, as a kill -9 would. */
	static void crash(String where) {
		System.err.println("crashing (" + where + ")");
		Runtime.getRuntime().halt(137);
	}

	/** Works on the queue until SIGTERM. */
	static void worker(HikariDataSource pool) throws Exception {
		createTables(pool);
		long expire = Long.parseLong(System.getenv().getOrDefault("JOBS_EXPIRE_SECONDS", "60"));
		DataSource schedulerDs = pool;
		RequestTransactions transactions = new JdbcRequestTransactions(pool);
		if (AckInTransaction.on()) {
			AckInTransaction ack = new AckInTransaction(pool);
			schedulerDs = ack;
			transactions = ack;
		}
		// Dead after missing 4 heartbeats: a delivery whose worker is gone runs again after JOBS_EXPIRE_SECONDS.
		Scheduler scheduler = Scheduler.create(schedulerDs, chargeTask(pool, transactions))
				.threads(4)
				.pollingInterval(Duration.ofMillis(200))
				.heartbeatInterval(Duration.ofMillis(Math.max(250, expire * 1000 / 4)))
				.missedHeartbeatsLimit(4)
				.pollUsingLockAndFetch(0.5, 1.0)
				.build();
		CountDownLatch stopped = new CountDownLatch(1);
		Runtime.getRuntime().addShutdownHook(new Thread(() -> {
			scheduler.stop();
			stopped.countDown();
		}));
		scheduler.start();
		stopped.await();
	}

	/** Schedules a task charging amount now; returns its id (the idempotency key). */
	static String enqueue(DataSource ds, int amount) throws SQLException {
		createTables(ds);
		String id = UUID.randomUUID().toString();
		SchedulerClient client = SchedulerClient.Builder.create(ds, chargeTask(ds, null)).build();
		client.scheduleIfNotExists(chargeTask(ds, null).instance(id, amount), Instant.now());
		return id;
	}

	/**
	 * The task's state and output: "scheduled" or "picked" while db-scheduler holds its execution;
	 * "completed" and its result (from the idempotency record) once db-scheduler removed it after a
	 * run; "none" when neither knows it.
	 */
	static String status(DataSource ds, String id) throws SQLException {
		try (Connection c = ds.getConnection()) {
			try (PreparedStatement st = c.prepareStatement(
					"SELECT picked FROM scheduled_tasks WHERE task_name = ? AND task_instance = ?")) {
				st.setString(1, TASK);
				st.setString(2, id);
				try (ResultSet rs = st.executeQuery()) {
					if (rs.next()) {
						return rs.getBoolean(1) ? "picked null" : "scheduled null";
					}
				}
			}
			Optional<KeyRecord> record = Idempotency.lookup(c, SCOPE, id);
			if (record.isPresent() && "completed".equals(record.get().state())) {
				return "completed " + new String(record.get().body(), StandardCharsets.UTF_8);
			}
			return "none";
		}
	}
}
