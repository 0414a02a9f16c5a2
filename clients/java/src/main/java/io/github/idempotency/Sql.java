package io.github.idempotency;

import io.opentelemetry.api.trace.Tracer;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Types;
import java.time.Duration;
import java.time.OffsetDateTime;
import org.postgresql.PGStatement;

/** The SQL the client sends, and the conversions between JDBC and its types. */
final class Sql {
	private Sql() {
	}

	/** claim, one round trip. */
	static final String CLAIM = "SELECT c.outcome, c.fence, c.attempt, c.status_code, c.body, c.recovery_point,"
			+ " c.recovery_state::text AS recovery_state, c.retry_after, c.created_at,"
			+ " c.headers::text AS headers FROM idempotency.claim(?, ?, ?, ?::interval, ?::interval, ?::interval, ?::uuid) c";

	/**
	 * A response kept after its one transaction rolled back, claim and all: claim and complete in one
	 * statement (no row when the claim is not new). The claim waits as the request's did (a duplicate's
	 * uncommitted claim no longer than that).
	 */
	static final String CLAIM_AND_COMPLETE = "SELECT idempotency.complete(a.key, c.fence, a.status, a.body, a.headers, a.scope)"
			+ " FROM (SELECT ?::text AS key, ?::bytea AS fingerprint, ?::text AS scope, ?::interval AS lease,"
			+ " ?::interval AS retention, ?::int AS status, ?::bytea AS body, ?::jsonb AS headers,"
			+ " ?::interval AS wait) a,"
			+ " idempotency.claim(a.key, a.fingerprint, a.scope, a.lease, a.retention, a.wait) c"
			+ " WHERE c.outcome OPERATOR(pg_catalog.=) 'new'";

	/** A 5xx kept that way, only when idempotency.store_server_errors is on (no row otherwise). */
	static final String KEEP_SERVER_ERROR = CLAIM_AND_COMPLETE
			+ " AND pg_catalog.current_setting('idempotency.store_server_errors', true)::boolean";

	/** lookup, one round trip; the lease in microseconds. */
	static final String LOOKUP = "SELECT l.scope, l.key, l.fingerprint, l.state, l.attempt,"
			+ " (extract(epoch FROM l.lease) * 1000000)::bigint AS lease_us, l.lease_expires_at,"
			+ " l.recovery_point, l.recovery_state::text AS recovery_state, l.status_code, l.body,"
			+ " l.created_at, l.completed_at, l.expires_at,"
			+ " l.headers::text AS headers FROM idempotency.lookup(?, ?) l";

	/**
	 * Prepares sql on db: as an unnamed statement each time it runs, unless prepared. pgjdbc would make
	 * a statement a named server-side one after its fifth use on a connection (prepareThreshold 5), which
	 * a transaction pooler before pgbouncer 1.21 breaks: the next transaction may run on another server
	 * connection, where the name does not exist (26000) or is another client's (42P05). Prepared, it is
	 * a named statement from its first use, kept in the connection's statement cache: the server parses
	 * and plans it once per connection, not on every call.
	 */
	static PreparedStatement prepare(Connection db, boolean prepared, String sql) throws SQLException {
		PreparedStatement st = db.prepareStatement(sql);
		if (st.isWrapperFor(PGStatement.class)) {
			st.unwrap(PGStatement.class).setPrepareThreshold(prepared ? 1 : 0);
		}
		return st;
	}

	/** Reads claim's row into a result. */
	static ClaimResult readClaim(ClaimRequest req, ResultSet rs, Tracer tracer) throws SQLException {
		OffsetDateTime created = rs.getObject("created_at", OffsetDateTime.class);
		switch (Outcome.of(rs.getString("outcome"))) {
			case NEW:
				return new ClaimResult.New(req.scope(), req.key(), rs.getLong("fence"), rs.getInt("attempt"),
						rs.getString("recovery_point"), rs.getString("recovery_state"), created, tracer, req.prepared());
			case REPLAY:
				return new ClaimResult.Replay(rs.getInt("status_code"), Json.readHeaders(rs.getString("headers")),
						orEmpty(rs.getBytes("body")), created);
			case IN_PROGRESS:
				return new ClaimResult.InProgress(Math.max(1, rs.getInt("retry_after")), created);
			default:
				return new ClaimResult.Mismatch(created);
		}
	}

	/** Sets parameters 1 to 5 to req's key, fingerprint, scope, lease and retention. */
	static void setClaim(PreparedStatement st, ClaimRequest req) throws SQLException {
		st.setString(1, req.key());
		setBytes(st, 2, req.fingerprint());
		st.setString(3, req.scope());
		st.setString(4, interval(req.lease()));
		st.setString(5, interval(req.retention()));
	}

	/** Sets parameter i to bytes, or to NULL. */
	static void setBytes(PreparedStatement st, int i, byte[] bytes) throws SQLException {
		if (bytes == null) {
			st.setNull(i, Types.BINARY);
		} else {
			st.setBytes(i, bytes);
		}
	}

	/** d as an interval's text ("N microseconds"), null for null (the setting applies). */
	static String interval(Duration d) {
		if (d == null) {
			return null;
		}
		long micros = Math.addExact(Math.multiplyExact(d.getSeconds(), 1_000_000L), d.getNano() / 1000);
		return micros + " microseconds";
	}

	/** Runs st and returns the text of its one row's first column. */
	static String single(PreparedStatement st) throws SQLException {
		try (ResultSet rs = st.executeQuery()) {
			rs.next();
			return rs.getString(1);
		}
	}

	/** Runs st and returns its one row's first column as a boolean. */
	static boolean singleBoolean(PreparedStatement st) throws SQLException {
		try (ResultSet rs = st.executeQuery()) {
			rs.next();
			return rs.getBoolean(1);
		}
	}

	/** bytes, or an empty array for null. */
	static byte[] orEmpty(byte[] bytes) {
		return bytes == null ? new byte[0] : bytes;
	}
}
