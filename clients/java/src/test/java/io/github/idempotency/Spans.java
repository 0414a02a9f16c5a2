package io.github.idempotency;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;

import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.data.SpanData;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

/** An OpenTelemetry SDK whose spans stay in memory, for the tests. */
public final class Spans {
	/** Where the spans go. */
	public final InMemorySpanExporter exporter = InMemorySpanExporter.create();
	/** The SDK. */
	public final OpenTelemetrySdk sdk = OpenTelemetrySdk.builder()
			.setTracerProvider(SdkTracerProvider.builder().addSpanProcessor(SimpleSpanProcessor.create(exporter)).build())
			.build();

	/** The spans ended so far whose key_hash is the hash of key, in the order they ended. */
	public List<SpanData> of(String key) {
		String hash = Telemetry.keyHash(key);
		return exporter.getFinishedSpanItems().stream()
				.filter(s -> hash.equals(s.getAttributes().get(AttributeKey.stringKey("idempotency.key_hash"))))
				.collect(Collectors.toList());
	}

	/** "name outcome" of each span of key, in order: e.g. "idempotency.claim new". */
	public List<String> summary(String key) {
		return of(key).stream()
				.map(s -> s.getName() + " " + s.getAttributes().get(AttributeKey.stringKey("idempotency.outcome")))
				.collect(Collectors.toList());
	}

	/**
	 * Checks every span ended so far: kind INTERNAL, a name of the client's, a 16-hex-digit key hash,
	 * and no attribute (nor event, nor status text) holding any of the secrets (keys, bodies, scopes).
	 */
	public void assertClean(String... secrets) {
		List<SpanData> all = exporter.getFinishedSpanItems();
		for (SpanData s : all) {
			assertEquals(SpanKind.INTERNAL, s.getKind(), s.getName());
			assertFalse(!s.getName().matches("idempotency\\.(claim|complete|release)"), s.getName());
			String hash = s.getAttributes().get(AttributeKey.stringKey("idempotency.key_hash"));
			assertFalse(hash == null || !hash.matches("[0-9a-f]{16}"), String.valueOf(hash));
			StringBuilder text = new StringBuilder(s.getStatus().getDescription());
			for (Map.Entry<AttributeKey<?>, Object> a : s.getAttributes().asMap().entrySet()) {
				text.append(' ').append(a.getKey().getKey()).append('=').append(a.getValue());
			}
			s.getEvents().forEach(e -> text.append(' ').append(e.getName()).append(e.getAttributes()));
			for (String secret : secrets) {
				assertFalse(text.toString().contains(secret), s.getName() + " holds " + secret + ": " + text);
			}
		}
	}
}
