package io.github.idempotency;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.charset.StandardCharsets;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/** What needs no database: the key parser, the URL, the problem bodies, the fingerprint's encoding. */
class UnitTest {

	@Test
	void keysQuotedAndBare() {
		assertEquals("order-42", IdempotencyKey.parse(List.of("\"order-42\"")));
		assertEquals("order-42", IdempotencyKey.parse(List.of("order-42")));
		assertEquals("order-42", IdempotencyKey.parse(List.of(" \t\"order-42\" ")));
		assertEquals("say \"hi\" \\ bye", IdempotencyKey.parse(List.of("\"say \\\"hi\\\" \\\\ bye\"")));
		assertEquals("urn:a/b", IdempotencyKey.parse(List.of("urn:a/b")));
		assertNull(IdempotencyKey.parse(List.of()));
		assertEquals("k".repeat(255), IdempotencyKey.parse(List.of("k".repeat(255))));
	}

	@ParameterizedTest
	@ValueSource(strings = {"\"unterminated", "\"abc\";x=1", "?1", ":YWJj:", "(a b)", "\"\"", "\"a\\qb\"",
			"\"a\", \"b\"", "a b", "", "\"é\""})
	void malformedKeys(String field) {
		assertThrows(IllegalArgumentException.class, () -> IdempotencyKey.parse(List.of(field)));
	}

	@Test
	void keyTooLongOrSentTwice() {
		assertThrows(IllegalArgumentException.class, () -> IdempotencyKey.parse(List.of("k".repeat(256))));
		assertThrows(IllegalArgumentException.class, () -> IdempotencyKey.parse(List.of("\"a\"", "\"b\"")));
	}

	@Test
	void libpqUrls() {
		assertEquals("jdbc:postgresql://127.0.0.1:5433/app?user=postgres",
				PostgresUrl.toJdbc("postgresql://postgres@127.0.0.1:5433/app"));
		assertEquals("jdbc:postgresql://db:5432/app?user=u&password=p%40ss&sslmode=require",
				PostgresUrl.toJdbc("postgres://u:p%40ss@db/app?sslmode=require"));
		assertEquals("jdbc:postgresql://localhost:5432/app?user=postgres"
				+ "&socketFactory=org.newsclub.net.unix.AFUNIXSocketFactory$FactoryArg"
				+ "&socketFactoryArg=/run/postgresql/.s.PGSQL.5432",
				PostgresUrl.toJdbc("postgresql://postgres@/app?host=/run/postgresql"));
		assertEquals("jdbc:postgresql://localhost:6000/app?socketFactory=org.newsclub.net.unix.AFUNIXSocketFactory$FactoryArg"
				+ "&socketFactoryArg=/tmp/pg/.s.PGSQL.6000",
				PostgresUrl.toJdbc("postgresql:///app?host=%2Ftmp%2Fpg&port=6000"));
		assertEquals("jdbc:postgresql://h:1/d", PostgresUrl.toJdbc("jdbc:postgresql://h:1/d"));
		assertThrows(IllegalArgumentException.class, () -> PostgresUrl.toJdbc("mysql://x/y"));
	}

	@Test
	void problemBody() {
		String json = new String(Problem.inProgress(0).toJson(), StandardCharsets.UTF_8);
		assertEquals("{\"type\":\"about:blank\",\"title\":\"Conflict\",\"status\":409,\"detail\":"
				+ "\"a request with this Idempotency-Key is still in progress; retry after Retry-After seconds\","
				+ "\"code\":\"idempotency_key_in_progress\"}", json);
		assertEquals(1, Problem.inProgress(0).retryAfter());
		java.util.Map<String, List<String>> headers = new java.util.LinkedHashMap<>();
		headers.put("a", List.of("x\"\n"));
		headers.put("b", List.of("1", "2"));
		assertEquals("{\"a\":\"x\\\"\\u000a\",\"b\":[\"1\",\"2\"]}", Json.headers(headers));
	}

	@Test
	void fingerprintEncoding() {
		// The length prefixes: ("a", "bc") and ("ab", "c") differ; absent and empty differ; the method's case does not.
		assertFalse(java.util.Arrays.equals(Fingerprint.of("POST", "a", "bc".getBytes(), null),
				Fingerprint.of("POST", "ab", "c".getBytes(), null)));
		assertFalse(java.util.Arrays.equals(Fingerprint.of("POST", "/", null, null),
				Fingerprint.of("POST", "/", new byte[0], null)));
		assertArrayEquals(Fingerprint.of("post", "/p", null, "q=1"), Fingerprint.of("POST", "/p", null, "q=1"));
		assertTrue(HexFormat.of().formatHex(Fingerprint.of("POST", "/", null, null)).length() == 64);
	}

	@Test
	void claimRequestNeedsScopeAndKey() {
		assertThrows(NullPointerException.class, () -> ClaimRequest.of(null, "k", new byte[1]));
		assertEquals("1000000 microseconds", Sql.interval(java.time.Duration.ofSeconds(1)));
	}
}
