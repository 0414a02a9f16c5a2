package io.github.idempotency;

import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Scope;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.time.Duration;
import java.time.OffsetDateTime;
import java.util.Optional;
import java.util.UUID;
import javax.sql.DataSource;

/**
 * The extension's SQL API over JDBC: {@link #claim}, then {@link ClaimResult.New#complete complete},
 * {@link ClaimResult.New#release release}, {@link ClaimResult.New#extend extend} or
 * {@link ClaimResult.New#checkpoint checkpoint} on the {@code New} it returns; {@link #lookup};
 * {@link #fingerprint}.
 *
 * <p>Claim outside the business transaction (on a {@link DataSource}, or a connection in autocommit), so
 * that the claim commits at once and a concurrent retry sees it; complete on the connection of the
 * business transaction, so that the writes and the stored response commit together. The scope is always
 * passed: pooled connections carry no state between requests.
 */
public final class Idempotency {
	private Idempotency() {
	}

	/**
	 * Claims {@code req.key()} for the request {@code req.fingerprint()} identifies: the one call that
	 * decides whether to run a request. One round trip; it commits with the connection's transaction
	 * (at once in autocommit).
	 *
	 * @param db the connection
	 * @param req the claim's arguments
	 * @return the outcome, with what it carries
	 * @throws SQLException {@link InvalidArgumentException} for a refused key or interval,
	 *     {@link RetryableException} for 40001 and 55P03, the driver's error when the connection failed
	 */
	public static ClaimResult claim(Connection db, ClaimRequest req) throws SQLException {
		return claim(db, req, null);
	}

	/**
	 * {@link #claim(Connection, ClaimRequest)} with its span on {@code tracer}, and the {@code New}'s
	 * complete and release spans too ({@link Telemetry#tracer}).
	 *
	 * @param db the connection
	 * @param req the claim's arguments
	 * @param tracer where the spans go; null: the global OpenTelemetry's
	 * @return the outcome
	 * @throws SQLException as {@link #claim(Connection, ClaimRequest)}
	 */
	@SuppressWarnings("try") // the span's scope is only closed
	public static ClaimResult claim(Connection db, ClaimRequest req, Tracer tracer) throws SQLException {
		Span span = Telemetry.start(tracer, "claim", req.key());
		try (Scope ignored = span.makeCurrent(); PreparedStatement st = Sql.prepare(db, req.prepared(), Sql.CLAIM)) {
			Sql.setClaim(st, req);
			st.setString(6, Sql.interval(req.waitFor()));
			st.setString(7, req.token() == null ? null : req.token().toString());
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				ClaimResult r = Sql.readClaim(req, rs, tracer);
				span.setAttribute("idempotency.outcome", r.outcome().text());
				if (r instanceof ClaimResult.New won) {
					span.setAttribute("idempotency.attempt", won.attempt());
				}
				return r;
			}
		} catch (SQLException e) {
			SQLException thrown = IdempotencyException.of("claim", e);
			Telemetry.fail(span, thrown);
			throw thrown;
		} catch (RuntimeException e) {
			Telemetry.fail(span, e);
			throw e;
		} finally {
			span.end();
		}
	}

	/**
	 * Claims on a connection of {@code ds} of its own, committed before it returns (also when the pool
	 * hands out connections with autocommit off), and given back to the pool at once.
	 *
	 * @param ds the data source
	 * @param req the claim's arguments
	 * @return the outcome
	 * @throws SQLException as {@link #claim(Connection, ClaimRequest)}, or the pool's error
	 */
	public static ClaimResult claim(DataSource ds, ClaimRequest req) throws SQLException {
		return claim(ds, req, null);
	}

	/**
	 * {@link #claim(DataSource, ClaimRequest)} with its spans on {@code tracer}.
	 *
	 * @param ds the data source
	 * @param req the claim's arguments
	 * @param tracer where the spans go; null: the global OpenTelemetry's
	 * @return the outcome
	 * @throws SQLException as {@link #claim(DataSource, ClaimRequest)}
	 */
	public static ClaimResult claim(DataSource ds, ClaimRequest req, Tracer tracer) throws SQLException {
		try (Connection c = ds.getConnection()) {
			if (c.getAutoCommit()) {
				return claim(c, req, tracer);
			}
			try {
				ClaimResult r = claim(c, req, tracer);
				TransactionCommands.commit(c);
				return r;
			} catch (SQLException | RuntimeException e) {
				rollbackQuietly(c);
				throw e;
			}
		}
	}

	/**
	 * For a middleware that claims in the handler's transaction (one transaction per request), after a
	 * 5xx rolled that transaction back, claim and all: stores the 5xx for replay when the setting
	 * {@code idempotency.store_server_errors} is on, as {@code complete} would have, in one statement
	 * that commits at once; with the setting off it writes nothing (the 5xx is released). Its span is
	 * an {@code idempotency.complete}.
	 *
	 * @param db a connection in autocommit
	 * @param req the request's claim (its lease, retention, scope)
	 * @param statusCode the 5xx
	 * @param body the response body, null for none
	 * @param headers the headers a replay repeats, null or empty for none
	 * @param tracer where the span goes; null: the global OpenTelemetry's
	 * @return {@code STORED}, or {@code RELEASED} when nothing is kept (the setting is off, or another
	 *     request holds the key now)
	 * @throws SQLException an error of the server or of the connection
	 */
	public static ClaimResult.Completion keepServerError(Connection db, ClaimRequest req, int statusCode,
			byte[] body, java.util.Map<String, java.util.List<String>> headers, Tracer tracer) throws SQLException {
		return claimAndComplete(db, Sql.KEEP_SERVER_ERROR, req, statusCode, body, headers, tracer);
	}

	/**
	 * For one transaction, after the work failed with an error that is kept (the idempotent function's
	 * final errors): claims and completes in one statement that commits at once, whatever the status.
	 *
	 * @param db a connection in autocommit
	 * @param req the work's claim (its lease, retention, scope)
	 * @param statusCode the status to store
	 * @param body the body, null for none
	 * @param headers the headers, null or empty for none
	 * @param tracer where the span goes; null: the global OpenTelemetry's
	 * @return {@code STORED}, or {@code RELEASED} when another caller holds the key now
	 * @throws SQLException an error of the server or of the connection
	 */
	public static ClaimResult.Completion claimAndComplete(Connection db, ClaimRequest req, int statusCode,
			byte[] body, java.util.Map<String, java.util.List<String>> headers, Tracer tracer) throws SQLException {
		return claimAndComplete(db, Sql.CLAIM_AND_COMPLETE, req, statusCode, body, headers, tracer);
	}

	/** Runs sql, one of Sql's claim-and-complete statements. */
	@SuppressWarnings("try") // the span's scope is only closed
	private static ClaimResult.Completion claimAndComplete(Connection db, String sql, ClaimRequest req, int statusCode,
			byte[] body, java.util.Map<String, java.util.List<String>> headers, Tracer tracer) throws SQLException {
		Span span = Telemetry.start(tracer, "complete", req.key());
		try (Scope ignored = span.makeCurrent(); PreparedStatement st = Sql.prepare(db, req.prepared(), sql)) {
			Sql.setClaim(st, req);
			st.setInt(6, statusCode);
			Sql.setBytes(st, 7, body);
			st.setString(8, headers == null || headers.isEmpty() ? null : Json.headers(headers));
			st.setString(9, Sql.interval(req.waitFor()));
			String answer;
			try (ResultSet rs = st.executeQuery()) {
				answer = rs.next() ? rs.getString(1) : "released";
			}
			span.setAttribute("idempotency.outcome", answer);
			return ClaimResult.Completion.valueOf(answer.toUpperCase(java.util.Locale.ROOT));
		} catch (SQLException e) {
			SQLException thrown = IdempotencyException.of("complete", e);
			Telemetry.fail(span, thrown);
			throw thrown;
		} finally {
			span.end();
		}
	}

	/**
	 * Reads the record of (scope, key) as a claim would see it, without its fence. It only reads: it
	 * works in a read-only transaction and on a standby.
	 *
	 * @param db the connection
	 * @param scope the scope ({@code ""}: unscoped)
	 * @param key the key
	 * @return the record; empty when it is absent or expired
	 * @throws SQLException an error of the server or of the connection
	 */
	public static Optional<KeyRecord> lookup(Connection db, String scope, String key) throws SQLException {
		try (PreparedStatement st = Sql.prepare(db, false, Sql.LOOKUP)) {
			st.setString(1, key);
			st.setString(2, scope);
			try (ResultSet rs = st.executeQuery()) {
				if (!rs.next()) {
					return Optional.empty();
				}
				long leaseMicros = rs.getLong("lease_us");
				Duration lease = rs.wasNull() ? null : Duration.ofNanos(leaseMicros * 1000);
				return Optional.of(new KeyRecord(rs.getString("scope"), rs.getString("key"),
						rs.getBytes("fingerprint"), rs.getString("state"), rs.getInt("attempt"), lease,
						rs.getObject("lease_expires_at", OffsetDateTime.class), rs.getString("recovery_point"),
						rs.getString("recovery_state"), rs.getObject("status_code", Integer.class),
						Json.readHeaders(rs.getString("headers")), rs.getBytes("body"),
						rs.getObject("created_at", OffsetDateTime.class),
						rs.getObject("completed_at", OffsetDateTime.class),
						rs.getObject("expires_at", OffsetDateTime.class)));
			}
		} catch (SQLException e) {
			throw IdempotencyException.of("lookup", e);
		}
	}

	/**
	 * {@code idempotency.fingerprint(method, path, body, query)} computed by the database; {@link
	 * Fingerprint#of} computes the same bytes without a round trip.
	 *
	 * @param db the connection
	 * @param method the HTTP method
	 * @param path the path, without the query
	 * @param body the body, null for none
	 * @param query the query, null for none
	 * @return 32 bytes
	 * @throws SQLException an error of the server or of the connection
	 */
	public static byte[] fingerprint(Connection db, String method, String path, byte[] body, String query)
			throws SQLException {
		try (PreparedStatement st = Sql.prepare(db, false, "SELECT idempotency.fingerprint(?, ?, ?, ?)")) {
			st.setString(1, method);
			st.setString(2, path);
			Sql.setBytes(st, 3, body);
			st.setString(4, query);
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				return rs.getBytes(1);
			}
		} catch (SQLException e) {
			throw IdempotencyException.of("fingerprint", e);
		}
	}

	/**
	 * A new claim token, a random UUID (version 4): one per incoming request, given to each of its claims.
	 *
	 * @return the token
	 */
	public static UUID newToken() {
		return UUID.randomUUID();
	}

	/**
	 * Whether {@code e} means that the answer was lost rather than given: no SQLSTATE, a connection
	 * exception (class 08) or a shutdown (57P01, 57P02, 57P03). An error the server answered with is not
	 * one: it is an answer.
	 *
	 * @param e the error
	 * @return true when the connection failed
	 */
	public static boolean isConnectionLost(SQLException e) {
		String state = e.getSQLState();
		return state == null || state.startsWith("08") || state.startsWith("57P0");
	}

	/** Rolls c back, ignoring an error: the caller reports its own. */
	static void rollbackQuietly(Connection c) {
		try {
			TransactionCommands.rollback(c);
		} catch (SQLException ignored) {
			// the connection is gone: nothing committed
		}
	}
}
