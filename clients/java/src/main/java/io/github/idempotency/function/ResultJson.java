package io.github.idempotency.function;

import java.lang.reflect.Type;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.List;
import tools.jackson.databind.JsonNode;
import tools.jackson.databind.json.JsonMapper;
import tools.jackson.databind.node.ObjectNode;

/** The JSON of idempotent functions (Jackson, as Spring Boot's): stored results, fingerprints. */
final class ResultJson {
	private static final JsonMapper MAPPER = JsonMapper.builder().build();

	private ResultJson() {
	}

	/** value as stored: its JSON. */
	static byte[] write(Object value) {
		return MAPPER.writeValueAsBytes(value);
	}

	/** The stored JSON back as type; null for a void result. */
	static Object read(byte[] json, Type type) {
		if (type == void.class || type == Void.class) {
			return null;
		}
		return MAPPER.readValue(json, MAPPER.constructType(type));
	}

	/** What a final error stores: its class name and message. */
	static byte[] error(Throwable e) {
		ObjectNode node = MAPPER.createObjectNode();
		node.put("class", e.getClass().getName());
		node.put("message", String.valueOf(e.getMessage()));
		return MAPPER.writeValueAsBytes(node);
	}

	/** A stored final error back as the exception duplicates get. */
	static IdempotentCallException.Stored storedError(String key, byte[] json) {
		JsonNode node = MAPPER.readTree(json);
		return new IdempotentCallException.Stored(key, node.path("class").asString(), node.path("message").asString());
	}

	/**
	 * The fingerprint of a call's arguments: SHA-256 of "pg-idempotency function\n" and their canonical
	 * JSON ({@link CanonicalJson}), the bytes every client of the project makes of the same arguments.
	 */
	static byte[] fingerprint(List<Object> args) {
		String text = "pg-idempotency function\n" + CanonicalJson.write(MAPPER.valueToTree(args));
		try {
			return MessageDigest.getInstance("SHA-256").digest(text.getBytes(StandardCharsets.UTF_8));
		} catch (NoSuchAlgorithmException e) {
			throw new IllegalStateException(e);
		}
	}
}
