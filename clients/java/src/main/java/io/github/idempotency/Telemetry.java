package io.github.idempotency;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.api.trace.Tracer;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.sql.SQLException;
import java.util.HexFormat;

/**
 * The client's OpenTelemetry spans, the same in every client of the project: {@code idempotency.claim},
 * {@code idempotency.complete} and {@code idempotency.release}, kind INTERNAL, with
 * {@code idempotency.outcome}, {@code idempotency.attempt} (a claim that won) and
 * {@code idempotency.key_hash}, never the key, the scope or a body; an error sets the status to ERROR
 * and its SQLSTATE as {@code db.response.status_code}. Through the API only: without an SDK the tracer
 * is a no-op.
 */
public final class Telemetry {
	/** The instrumentation scope's name. */
	public static final String SCOPE = "io.github.idempotency";

	private Telemetry() {
	}

	/**
	 * The client's tracer from {@code openTelemetry}.
	 *
	 * @param openTelemetry the application's OpenTelemetry
	 * @return its tracer for this client
	 */
	public static Tracer tracer(OpenTelemetry openTelemetry) {
		String version = Telemetry.class.getPackage().getImplementationVersion();
		return version == null ? openTelemetry.getTracer(SCOPE) : openTelemetry.getTracer(SCOPE, version);
	}

	/** given, or the global OpenTelemetry's tracer when null (looked up at each call, as the API asks). */
	static Tracer orGlobal(Tracer given) {
		return given != null ? given : tracer(GlobalOpenTelemetry.get());
	}

	/** Starts span idempotency.{call} of key, a child of the current context. */
	static Span start(Tracer tracer, String call, String key) {
		return orGlobal(tracer).spanBuilder("idempotency." + call).setSpanKind(SpanKind.INTERNAL)
				.setAttribute("idempotency.key_hash", keyHash(key)).startSpan();
	}

	/** Marks span as failed by e, with its SQLSTATE when the server gave one. */
	static void fail(Span span, Throwable e) {
		span.setStatus(StatusCode.ERROR);
		if (e instanceof SQLException sql && sql.getSQLState() != null) {
			span.setAttribute("db.response.status_code", sql.getSQLState());
		}
	}

	/**
	 * The first 16 lowercase hex digits of SHA-256 of the key's UTF-8 bytes: what the spans name a key
	 * by, the same in every client.
	 *
	 * @param key the key
	 * @return 16 hex digits
	 */
	public static String keyHash(String key) {
		try {
			byte[] sum = MessageDigest.getInstance("SHA-256").digest(key.getBytes(StandardCharsets.UTF_8));
			return HexFormat.of().formatHex(sum, 0, 8);
		} catch (NoSuchAlgorithmException e) {
			throw new IllegalStateException(e);
		}
	}
}
