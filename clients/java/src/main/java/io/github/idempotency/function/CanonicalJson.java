package io.github.idempotency.function;

import java.math.BigDecimal;
import java.math.MathContext;
import java.math.RoundingMode;
import java.util.Map;
import java.util.TreeMap;
import tools.jackson.databind.JsonNode;
import tools.jackson.databind.json.JsonMapper;

/**
 * The canonical JSON of a function's arguments, the same bytes in every client of the project
 * (clients/testdata/function-fingerprints.json): as JavaScript's {@code JSON.stringify} writes them, with
 * object keys sorted by UTF-16 code units and no whitespace; integers as their digits, other numbers as
 * JavaScript writes a number (1.0 is 1, 1e21 is 1e+21).
 */
final class CanonicalJson {
	private static final JsonMapper MAPPER = JsonMapper.builder().build();
	private static final RoundingMode[] ROUNDINGS = {RoundingMode.HALF_EVEN, RoundingMode.FLOOR, RoundingMode.CEILING};

	private CanonicalJson() {
	}

	/** The canonical JSON of node. */
	static String write(JsonNode node) {
		StringBuilder b = new StringBuilder();
		append(b, node);
		return b.toString();
	}

	/** Appends node's canonical JSON to b. */
	private static void append(StringBuilder b, JsonNode node) {
		if (node.isObject()) {
			Map<String, JsonNode> sorted = new TreeMap<>(); // String's order: by UTF-16 code units
			node.properties().forEach(e -> sorted.put(e.getKey(), e.getValue()));
			b.append('{');
			for (Map.Entry<String, JsonNode> e : sorted.entrySet()) {
				b.append(b.charAt(b.length() - 1) == '{' ? "" : ",");
				quote(b, e.getKey());
				append(b.append(':'), e.getValue());
			}
			b.append('}');
		} else if (node.isArray()) {
			b.append('[');
			int i = 0;
			for (JsonNode element : node) {
				append(b.append(i++ > 0 ? "," : ""), element);
			}
			b.append(']');
		} else if (node.isString()) {
			quote(b, node.asString());
		} else if (node.isIntegralNumber()) {
			b.append(node.bigIntegerValue());
		} else if (node.isNumber()) {
			b.append(jsNumber(node.doubleValue()));
		} else {
			b.append(MAPPER.writeValueAsString(node)); // null, true, false, binary (base64)
		}
	}

	/** Appends s quoted as JSON.stringify quotes it: '"', '\', control characters and lone surrogates escaped. */
	private static void quote(StringBuilder b, String s) {
		b.append('"');
		for (int i = 0; i < s.length(); i++) {
			char c = s.charAt(i);
			switch (c) {
				case '"' -> b.append("\\\"");
				case '\\' -> b.append("\\\\");
				case '\b' -> b.append("\\b");
				case '\f' -> b.append("\\f");
				case '\n' -> b.append("\\n");
				case '\r' -> b.append("\\r");
				case '\t' -> b.append("\\t");
				default -> {
					if (Character.isHighSurrogate(c) && i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
						b.append(c).append(s.charAt(++i));
					} else if (c < 0x20 || Character.isSurrogate(c)) {
						b.append(String.format("\\u%04x", (int) c));
					} else {
						b.append(c);
					}
				}
			}
		}
		b.append('"');
	}

	/**
	 * x as JavaScript writes a number (ECMAScript Number::toString): the shortest digits that read back as
	 * x, without an exponent from 1e-6 up to 1e21, an integral value without ".0".
	 */
	static String jsNumber(double x) {
		if (Double.isNaN(x) || Double.isInfinite(x)) {
			throw new IllegalArgumentException(x + " has no canonical JSON form");
		}
		if (x == 0) {
			return "0";
		}
		BigDecimal shortest = shortest(Math.abs(x));
		String digits = shortest.unscaledValue().toString();
		int k = digits.length();
		int n = k - shortest.scale(); // |x| = 0.digits * 10^n
		String text;
		if (k <= n && n <= 21) {
			text = digits + "0".repeat(n - k);
		} else if (0 < n && n <= 21) {
			text = digits.substring(0, n) + "." + digits.substring(n);
		} else if (-6 < n && n <= 0) {
			text = "0." + "0".repeat(-n) + digits;
		} else {
			text = digits.charAt(0) + (k > 1 ? "." + digits.substring(1) : "") + "e" + (n > 0 ? "+" : "-")
					+ Math.abs(n - 1);
		}
		return x < 0 ? "-" + text : text;
	}

	/**
	 * The decimal of fewest digits that reads back as x, the nearest of them to x (Double.toString is
	 * not always the shortest before Java 19).
	 */
	private static BigDecimal shortest(double x) {
		BigDecimal exact = new BigDecimal(x);
		for (int precision = 1;; precision++) {
			for (RoundingMode rounding : ROUNDINGS) {
				BigDecimal candidate = exact.round(new MathContext(precision, rounding));
				if (candidate.doubleValue() == x) {
					return candidate.stripTrailingZeros();
				}
			}
		}
	}
}
