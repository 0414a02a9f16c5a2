package io.github.idempotency.function;

import java.lang.reflect.Type;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
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
	 * JSON (object keys sorted, no whitespace), the same encoding as the Node client's.
	 */
	static byte[] fingerprint(List<Object> args) {
		StringBuilder b = new StringBuilder("pg-idempotency function\n");
		canonical(b, MAPPER.valueToTree(args));
		try {
			return MessageDigest.getInstance("SHA-256").digest(b.toString().getBytes(StandardCharsets.UTF_8));
		} catch (NoSuchAlgorithmException e) {
			throw new IllegalStateException(e);
		}
	}

	/** Appends node's canonical JSON to b. */
	private static void canonical(StringBuilder b, JsonNode node) {
		if (node.isObject()) {
			Map<String, JsonNode> sorted = new TreeMap<>();
			node.properties().forEach(e -> sorted.put(e.getKey(), e.getValue()));
			b.append('{');
			for (Map.Entry<String, JsonNode> e : sorted.entrySet()) {
				b.append(b.length() > 0 && b.charAt(b.length() - 1) == '{' ? "" : ",");
				canonical(b.append(MAPPER.writeValueAsString(e.getKey())).append(':'), e.getValue());
			}
			b.append('}');
		} else if (node.isArray()) {
			b.append('[');
			int i = 0;
			for (JsonNode element : node) {
				canonical(b.append(i++ > 0 ? "," : ""), element);
			}
			b.append(']');
		} else {
			b.append(MAPPER.writeValueAsString(node));
		}
	}
}
