package io.github.idempotency;

import java.util.List;
import java.util.Map;

/** The little JSON the client writes: headers for complete, and problem bodies. */
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
}
