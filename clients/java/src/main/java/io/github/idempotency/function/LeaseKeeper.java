package io.github.idempotency.function;

import io.github.idempotency.ClaimLostException;
import io.github.idempotency.ClaimResult;
import java.lang.System.Logger.Level;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.time.Duration;
import java.util.Collections;
import java.util.Map;
import java.util.WeakHashMap;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import javax.sql.DataSource;

/** Two transactions: renews the lease of a run while its work goes on, until closed. */
final class LeaseKeeper implements AutoCloseable {
	private static final System.Logger LOG = System.getLogger(LeaseKeeper.class.getName());
	private static final ScheduledExecutorService TIMER = Executors.newSingleThreadScheduledExecutor(r -> {
		Thread t = new Thread(r, "idempotency-lease");
		t.setDaemon(true);
		return t;
	});

	/** The setting idempotency.lease per pool, read once (a pool's role keeps its settings). */
	private static final Map<DataSource, Duration> LEASE_SETTING = Collections.synchronizedMap(new WeakHashMap<>());

	private final ScheduledFuture<?> renewal;

	private LeaseKeeper(ScheduledFuture<?> renewal) {
		this.renewal = renewal;
	}

	/** Renews ticket's lease every options.extendEvery, or a third of the lease, on a connection of ds. */
	static LeaseKeeper start(DataSource ds, ClaimResult.New ticket, FunctionOptions<?> options) throws SQLException {
		long every = (options.extendEvery() != null ? options.extendEvery() : leaseInEffect(ds, options).dividedBy(3))
				.toMillis();
		ScheduledFuture<?> renewal = TIMER.scheduleWithFixedDelay(() -> {
			try (Connection db = ds.getConnection()) {
				db.setAutoCommit(true);
				ticket.extend(db, null);
			} catch (ClaimLostException e) {
				throw new IllegalStateException(e); // ends the renewals; complete will say so
			} catch (SQLException | RuntimeException e) {
				LOG.log(Level.WARNING, "idempotency: could not renew the lease: " + e);
			}
		}, Math.max(every, 1), Math.max(every, 1), TimeUnit.MILLISECONDS);
		return new LeaseKeeper(renewal);
	}

	/** The lease: the option, or the setting idempotency.lease of the pool's role (read once). */
	private static Duration leaseInEffect(DataSource ds, FunctionOptions<?> options) throws SQLException {
		if (options.lease() != null) {
			return options.lease();
		}
		Duration setting = LEASE_SETTING.get(ds);
		if (setting == null) {
			try (Connection db = ds.getConnection(); PreparedStatement st = db.prepareStatement(
					"SELECT (extract(epoch FROM COALESCE(pg_catalog.current_setting('idempotency.lease', true)"
							+ "::interval, interval '60 seconds')) * 1000)::bigint")) {
				try (ResultSet rs = st.executeQuery()) {
					rs.next();
					setting = Duration.ofMillis(rs.getLong(1));
				}
			}
			LEASE_SETTING.put(ds, setting);
		}
		return setting;
	}

	@Override
	public void close() {
		renewal.cancel(false);
	}
}
