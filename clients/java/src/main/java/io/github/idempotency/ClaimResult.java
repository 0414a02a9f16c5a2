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
import java.util.List;
import java.util.Map;

/**
 * What {@link Idempotency#claim} answers: one of {@link New} (run the request; it holds the fence),
 * {@link Replay}, {@link InProgress} and {@link Mismatch}. On Java 17, test with {@code instanceof} or
 * switch on {@link #outcome()}; from Java 21 on, switch on the type.
 */
public sealed interface ClaimResult permits ClaimResult.New, ClaimResult.Replay, ClaimResult.InProgress,
		ClaimResult.Mismatch {

	/**
	 * The outcome as an enum.
	 *
	 * @return the outcome
	 */
	Outcome outcome();

	/**
	 * When the key was first claimed.
	 *
	 * @return the record's created_at
	 */
	OffsetDateTime createdAt();

	/**
	 * {@code new}: this claim owns the key. Run the request, then {@link #complete} in the transaction of
	 * its business writes, or {@link #release}. Calls with a fence that no longer owns the claim raise
	 * {@link ClaimLostException}.
	 *
	 * @param scope the claim's scope
	 * @param key the claim's key
	 * @param fence the fencing token of this owner
	 * @param attempt 1, or more for a takeover of an ended lease
	 * @param recoveryPoint after a takeover, what the last owner checkpointed; else null
	 * @param recoveryState after a takeover, the last owner's state as JSON text; else null
	 * @param createdAt when the key was first claimed
	 * @param tracer where the spans of complete and release go; null: the global OpenTelemetry's
	 * @param prepared whether its calls are named server-side statements ({@link ClaimRequest#prepared})
	 */
	record New(String scope, String key, long fence, int attempt, String recoveryPoint, String recoveryState,
			OffsetDateTime createdAt, Tracer tracer, boolean prepared) implements ClaimResult {

		/**
		 * A claim that won, whose calls are unnamed statements.
		 *
		 * @param scope the claim's scope
		 * @param key the claim's key
		 * @param fence the fencing token of this owner
		 * @param attempt 1, or more for a takeover of an ended lease
		 * @param recoveryPoint after a takeover, what the last owner checkpointed; else null
		 * @param recoveryState after a takeover, the last owner's state as JSON text; else null
		 * @param createdAt when the key was first claimed
		 * @param tracer where the spans of complete and release go; null: the global OpenTelemetry's
		 */
		public New(String scope, String key, long fence, int attempt, String recoveryPoint, String recoveryState,
				OffsetDateTime createdAt, Tracer tracer) {
			this(scope, key, fence, attempt, recoveryPoint, recoveryState, createdAt, tracer, false);
		}

		/**
		 * A claim that won, whose spans go to the global OpenTelemetry.
		 *
		 * @param scope the claim's scope
		 * @param key the claim's key
		 * @param fence the fencing token of this owner
		 * @param attempt 1, or more for a takeover of an ended lease
		 * @param recoveryPoint after a takeover, what the last owner checkpointed; else null
		 * @param recoveryState after a takeover, the last owner's state as JSON text; else null
		 * @param createdAt when the key was first claimed
		 */
		public New(String scope, String key, long fence, int attempt, String recoveryPoint, String recoveryState,
				OffsetDateTime createdAt) {
			this(scope, key, fence, attempt, recoveryPoint, recoveryState, createdAt, null, false);
		}

		@Override
		public Outcome outcome() {
			return Outcome.NEW;
		}

		/**
		 * Stores the response and ends the claim. Run it on the connection of the transaction that holds
		 * the request's business writes, so that they and the response commit together.
		 *
		 * @param db the transaction's connection
		 * @param statusCode the response's status, 100 to 599
		 * @param body the response body, null for none
		 * @param headers the headers a replay repeats (a name to its values), null or empty for none
		 * @return {@code STORED}, or {@code RELEASED} for a 5xx that is not kept
		 * @throws ClaimLostException IK001: roll the transaction back
		 * @throws SQLException another error: {@link InvalidArgumentException} for 54000 (too large to
		 *     store) and 22023
		 */
		public Completion complete(Connection db, int statusCode, byte[] body, Map<String, List<String>> headers)
				throws SQLException {
			return complete(db, statusCode, body, headers, "");
		}

		/**
		 * {@link #complete} and the COMMIT of the connection's transaction, sent together: one round
		 * trip. On an error nothing commits (the server skips the COMMIT): roll back. When the answer is
		 * lost, whether it committed is not known: claim again with the token to learn it.
		 *
		 * @param db the transaction's connection, autocommit off; the driver's own commit() after this
		 *     sends nothing
		 * @param statusCode the response's status, 100 to 599
		 * @param body the response body, null for none
		 * @param headers the headers a replay repeats (a name to its values), null or empty for none
		 * @return {@code STORED}, or {@code RELEASED} for a 5xx that is not kept
		 * @throws ClaimLostException IK001: roll the transaction back
		 * @throws SQLException another error (of complete or of the COMMIT)
		 */
		public Completion completeAndCommit(Connection db, int statusCode, byte[] body,
				Map<String, List<String>> headers) throws SQLException {
			return complete(db, statusCode, body, headers, "; COMMIT");
		}

		/** complete, followed by then in the same message. */
		@SuppressWarnings("try") // the span's scope is only closed
		private Completion complete(Connection db, int statusCode, byte[] body, Map<String, List<String>> headers,
				String then) throws SQLException {
			String headersJson = headers == null || headers.isEmpty() ? null : Json.headers(headers);
			Span span = Telemetry.start(tracer, "complete", key);
			try (Scope ignored = span.makeCurrent(); PreparedStatement st = Sql.prepare(db, prepared,
					"SELECT idempotency.complete(?, ?, ?, ?, ?::jsonb, ?)" + then)) {
				st.setString(1, key);
				st.setLong(2, fence);
				st.setInt(3, statusCode);
				Sql.setBytes(st, 4, body);
				st.setString(5, headersJson);
				st.setString(6, scope);
				st.execute();
				String answer;
				try (ResultSet rs = st.getResultSet()) {
					rs.next();
					answer = rs.getString(1);
				}
				span.setAttribute("idempotency.outcome", answer);
				return Completion.valueOf(answer.toUpperCase(java.util.Locale.ROOT));
			} catch (SQLException e) {
				throw failed(span, "complete", e);
			} finally {
				span.end();
			}
		}

		/**
		 * Deletes the claim, so that the next retry runs the request again.
		 *
		 * @param db a connection (autocommit, or the caller commits)
		 * @return false when this fence no longer owns an in-progress claim
		 * @throws SQLException an error of the server or of the connection
		 */
		@SuppressWarnings("try") // the span's scope is only closed
		public boolean release(Connection db) throws SQLException {
			Span span = Telemetry.start(tracer, "release", key);
			try (Scope ignored = span.makeCurrent();
					PreparedStatement st = Sql.prepare(db, prepared, "SELECT idempotency.release(?, ?, ?)")) {
				st.setString(1, key);
				st.setLong(2, fence);
				st.setString(3, scope);
				boolean released = Sql.singleBoolean(st);
				span.setAttribute("idempotency.outcome", released ? "released" : "not_owned");
				return released;
			} catch (SQLException e) {
				throw failed(span, "release", e);
			} finally {
				span.end();
			}
		}

		/** The exception of call's error e, marked on span. */
		private static SQLException failed(Span span, String call, SQLException e) {
			SQLException thrown = IdempotencyException.of(call, e);
			Telemetry.fail(span, thrown);
			return thrown;
		}

		/**
		 * Renews the lease from now.
		 *
		 * @param db a connection
		 * @param lease the new lease length; null: the claim's own
		 * @return when the lease now ends
		 * @throws ClaimLostException IK001
		 * @throws SQLException another error
		 */
		public OffsetDateTime extend(Connection db, Duration lease) throws SQLException {
			try (PreparedStatement st = Sql.prepare(db, prepared,
					"SELECT idempotency.extend(?, ?, ?::interval, ?)")) {
				st.setString(1, key);
				st.setLong(2, fence);
				st.setString(3, Sql.interval(lease));
				st.setString(4, scope);
				try (ResultSet rs = st.executeQuery()) {
					rs.next();
					return rs.getObject(1, OffsetDateTime.class);
				}
			} catch (SQLException e) {
				throw IdempotencyException.of("extend", e);
			}
		}

		/**
		 * Saves the progress of multi-step work and renews the lease by the claim's own length; a
		 * takeover's {@code New} hands them to the next attempt.
		 *
		 * @param db a connection
		 * @param recoveryPoint where the work is
		 * @param recoveryStateJson what it needs to go on, as JSON text; null for none
		 * @throws ClaimLostException IK001
		 * @throws SQLException another error
		 */
		public void checkpoint(Connection db, String recoveryPoint, String recoveryStateJson) throws SQLException {
			try (PreparedStatement st = Sql.prepare(db, prepared,
					"SELECT idempotency.checkpoint(?, ?, ?, ?::jsonb, ?)")) {
				st.setString(1, key);
				st.setLong(2, fence);
				st.setString(3, recoveryPoint);
				st.setString(4, recoveryStateJson);
				st.setString(5, scope);
				st.executeQuery().close();
			} catch (SQLException e) {
				throw IdempotencyException.of("checkpoint", e);
			}
		}
	}

	/**
	 * {@code replay}: a completed request with the same fingerprint. Send its response again, byte for
	 * byte, with {@code Idempotent-Replayed: true}.
	 *
	 * @param statusCode the stored status
	 * @param headers the stored headers (a name to its values)
	 * @param body the stored body, empty when none
	 * @param createdAt when the key was first claimed
	 */
	record Replay(int statusCode, Map<String, List<String>> headers, byte[] body, OffsetDateTime createdAt)
			implements ClaimResult {
		@Override
		public Outcome outcome() {
			return Outcome.REPLAY;
		}
	}

	/**
	 * {@code in_progress}: another attempt holds the lease. Answer 409 with {@code Retry-After}.
	 *
	 * @param retryAfter whole seconds until the lease ends, at least 1
	 * @param createdAt when the key was first claimed
	 */
	record InProgress(int retryAfter, OffsetDateTime createdAt) implements ClaimResult {
		@Override
		public Outcome outcome() {
			return Outcome.IN_PROGRESS;
		}
	}

	/**
	 * {@code mismatch}: the key belongs to another request. Answer 422.
	 *
	 * @param createdAt when the key was first claimed
	 */
	record Mismatch(OffsetDateTime createdAt) implements ClaimResult {
		@Override
		public Outcome outcome() {
			return Outcome.MISMATCH;
		}
	}

	/** What {@link New#complete} did. */
	enum Completion {
		/** The response is kept and replayed. */
		STORED,
		/** A 5xx: nothing is kept, the next retry runs again. */
		RELEASED
	}
}
