package io.github.idempotency;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.sdk.trace.data.SpanData;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.sql.Connection;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.Test;

/** The core's spans, with the SDK's in-memory exporter, against the database. */
class TelemetryIT {
	private static final byte[] BODY = "{\"secret-body\":1}".getBytes(StandardCharsets.UTF_8);

	@Test
	void keyHashIsTheFirst16HexDigitsOfSha256() throws Exception {
		String sum = HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256")
				.digest("order-42é".getBytes(StandardCharsets.UTF_8)));
		assertEquals(sum.substring(0, 16), Telemetry.keyHash("order-42é"));
	}

	@Test
	void freshReplayMismatchInProgressAndRelease() throws Exception {
		Spans spans = new Spans();
		var tracer = Telemetry.tracer(spans.sdk);
		String key = TestDb.uniqueKey("secret-key");
		String scope = "secret-scope";
		byte[] fp = Fingerprint.of("POST", "/pay", BODY, null);
		try (Connection c = TestDb.connect()) {
			ClaimResult.New won = (ClaimResult.New) Idempotency.claim(c, ClaimRequest.of(scope, key, fp), tracer);
			assertTrue(Idempotency.claim(c, ClaimRequest.of(scope, key, fp), tracer) instanceof ClaimResult.InProgress);
			won.complete(c, 201, BODY, null);
			Idempotency.claim(c, ClaimRequest.of(scope, key, fp), tracer);
			Idempotency.claim(c, ClaimRequest.of(scope, key, Fingerprint.of("POST", "/other", null, null)), tracer);
			String released = TestDb.uniqueKey("secret-key");
			ClaimResult.New other = (ClaimResult.New) Idempotency.claim(c, ClaimRequest.of(scope, released, fp), tracer);
			other.release(c);
			other.release(c);
			assertEquals(List.of("idempotency.claim new", "idempotency.release released",
					"idempotency.release not_owned"), spans.summary(released));
		}
		assertEquals(List.of("idempotency.claim new", "idempotency.claim in_progress", "idempotency.complete stored",
				"idempotency.claim replay", "idempotency.claim mismatch"), spans.summary(key));
		SpanData first = spans.of(key).get(0);
		assertEquals(1L, first.getAttributes().get(AttributeKey.longKey("idempotency.attempt")));
		assertEquals(Telemetry.keyHash(key), first.getAttributes().get(AttributeKey.stringKey("idempotency.key_hash")));
		assertEquals(StatusCode.UNSET, first.getStatus().getStatusCode());
		assertEquals(null, spans.of(key).get(3).getAttributes().get(AttributeKey.longKey("idempotency.attempt")));
		spans.assertClean(key, scope, "secret-body", "secret-key", "secret-scope");
	}

	@Test
	void anErrorSetsTheStatusAndTheSqlstate() throws Exception {
		Spans spans = new Spans();
		var tracer = Telemetry.tracer(spans.sdk);
		String key = "secret-key\u0001" + java.util.UUID.randomUUID();
		try (Connection c = TestDb.connect()) {
			assertThrows(InvalidArgumentException.class,
					() -> Idempotency.claim(c, ClaimRequest.of("", key, new byte[] {1}), tracer));
			ClaimResult.New won = (ClaimResult.New) Idempotency.claim(c,
					ClaimRequest.of("", TestDb.uniqueKey("fenced"), new byte[] {1}), tracer);
			ClaimResult.New stale = new ClaimResult.New(won.scope(), won.key(), won.fence() - 1, 1, null, null,
					won.createdAt(), tracer);
			assertThrows(ClaimLostException.class, () -> stale.complete(c, 201, null, null));
			won.release(c);
		}
		SpanData refused = spans.of(key).get(0);
		assertEquals(StatusCode.ERROR, refused.getStatus().getStatusCode());
		assertEquals("22023", refused.getAttributes().get(AttributeKey.stringKey("db.response.status_code")));
		assertEquals(null, refused.getAttributes().get(AttributeKey.stringKey("idempotency.outcome")));
		SpanData lost = spans.exporter.getFinishedSpanItems().stream()
				.filter(s -> s.getName().equals("idempotency.complete")).findFirst().orElseThrow();
		assertEquals(StatusCode.ERROR, lost.getStatus().getStatusCode());
		assertEquals("IK001", lost.getAttributes().get(AttributeKey.stringKey("db.response.status_code")));
		spans.assertClean(key, "secret-key");
	}

	@Test
	void theGlobalOpenTelemetryByDefault() throws Exception {
		Spans spans = new Spans();
		GlobalOpenTelemetry.resetForTest();
		GlobalOpenTelemetry.set(spans.sdk);
		try (Connection c = TestDb.connect()) {
			String key = TestDb.uniqueKey("global");
			ClaimResult.New won = (ClaimResult.New) Idempotency.claim(c, ClaimRequest.of("", key, new byte[] {1}));
			won.complete(c, 200, null, null);
			assertEquals(List.of("idempotency.claim new", "idempotency.complete stored"), spans.summary(key));
			assertEquals(Telemetry.SCOPE, spans.of(key).get(0).getInstrumentationScopeInfo().getName());
		} finally {
			GlobalOpenTelemetry.resetForTest();
		}
	}
}
