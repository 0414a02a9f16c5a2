package io.github.idempotency;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * The little JSON the client writes (headers for complete, and problem bodies) and reads (the stored
 * headers), without a JSON library.
 */
final class Json {
	private Json() {
	}

	/** headers as the JSON object complete stores: a string per single value, an array for several. */
	static String headers(Map<String, List<String>> headers) {
		StringBuilder b = new StringBuilder("{");
		for (Map.Entry<String, List<String>> e : headers.entrySet()) {
			if (e.getValue().isEmpty()) {
				continue;
			}
			if (b.length() > 1) {
				b.append(',');
			}
			quote(b, e.getKey()).append(':');
			if (e.getValue().size() == 1) {
				quote(b, e.getValue().get(0));
			} else {
				b.append('[');
				for (int i = 0; i < e.getValue().size(); i++) {
					quote(b.append(i > 0 ? "," : ""), e.getValue().get(i));
				}
				b.append(']');
			}
		}
		return b.append('}').toString();
	}

	/** Appends s to b as a JSON string. */
	static StringBuilder quote(StringBuilder b, String s) {
		b.append('"');
		for (int i = 0; i < s.length(); i++) {
			char c = s.charAt(i);
			if (c == '"' || c == '\\') {
				b.append('\\').append(c);
			} else if (c < 0x20) {
				b.append(String.format("\\u%04x", (int) c));
			} else {
				b.append(c);
			}
		}
		return b.append('"');
	}

	/**
	 * The stored headers, jsonb's text of an object whose values are strings or arrays of strings (the
	 * only shape complete accepts), as a map ordered by name, each name's values in their order; empty
	 * for null. Reading the text here spares the server a query over jsonb_each that it would plan
	 * again on every claim of an unnamed statement.
	 */
	static Map<String, List<String>> readHeaders(String json) {
		if (json == null) {
			return Map.of();
		}
		Cursor c = new Cursor(json);
		Map<String, List<String>> headers = new TreeMap<>();
		c.expect('{');
		if (!c.eat('}')) {
			do {
				String name = c.string();
				c.expect(':');
				List<String> values = new ArrayList<>();
				if (!c.eat('[')) {
					values.add(c.string());
				} else if (!c.eat(']')) {
					do {
						values.add(c.string());
					} while (c.eat(','));
					c.expect(']');
				}
				headers.put(name, List.copyOf(values));
			} while (c.eat(','));
			c.expect('}');
		}
		return Collections.unmodifiableMap(headers);
	}

	/** A position in JSON text. */
	private static final class Cursor {
		private final String s;
		private int i;

		Cursor(String s) {
			this.s = s;
		}

		/** Skips whitespace; true, past it, when the next character is c. */
		boolean eat(char c) {
			while (i < s.length() && Character.isWhitespace(s.charAt(i))) {
				i++;
			}
			if (i < s.length() && s.charAt(i) == c) {
				i++;
				return true;
			}
			return false;
		}

		/** Skips whitespace and c, which must come next. */
		void expect(char c) {
			if (!eat(c)) {
				throw new IllegalStateException("stored headers: '" + c + "' expected at " + i + " of " + s);
			}
		}

		/** Reads a string, unescaped. */
		String string() {
			expect('"');
			StringBuilder b = new StringBuilder();
			for (char c = s.charAt(i++); c != '"'; c = s.charAt(i++)) {
				if (c != '\\') {
					b.append(c);
					continue;
				}
				char e = s.charAt(i++);
				switch (e) {
					case 'b' -> b.append('\b');
					case 'f' -> b.append('\f');
					case 'n' -> b.append('\n');
					case 'r' -> b.append('\r');
					case 't' -> b.append('\t');
					case 'u' -> {
						b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
						i += 4;
					}
					default -> b.append(e); // \" \\ \/
				}
			}
			return b.toString();
		}
	}
}
