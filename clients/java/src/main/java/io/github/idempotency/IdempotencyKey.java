package io.github.idempotency;

import java.nio.charset.StandardCharsets;
import java.util.List;

/**
 * The {@code Idempotency-Key} field of the HTTP contract: one Structured Field string (RFC 8941), or a
 * bare value of token characters that is the same key as its quoted form.
 */
public final class IdempotencyKey {
	/** The longest key the extension takes, in bytes. */
	public static final int MAX_BYTES = 255;

	/** Why a field is refused. */
	public static final String INVALID = "the Idempotency-Key header must be one Structured Field string "
			+ "of 1 to 255 bytes, such as \"8e03978e-40d5-43e8-bc93-6894a57f9324\"";

	private IdempotencyKey() {
	}

	/**
	 * The key that the field lines carry. A bare value (tchar, ':' and '/', not starting with ':') is the
	 * same key as its quoted form. Anything else, several lines, an empty key or one over 255 bytes is
	 * refused.
	 *
	 * @param lines the field's lines, as the request has them
	 * @return the key, or null when there is no line
	 * @throws IllegalArgumentException when the field is malformed
	 */
	public static String parse(List<String> lines) {
		if (lines.isEmpty()) {
			return null;
		}
		if (lines.size() > 1) {
			throw new IllegalArgumentException(INVALID);
		}
		String value = trim(lines.get(0));
		String key = value.startsWith("\"") ? unquote(value) : isBare(value) ? value : null;
		if (key == null || key.isEmpty() || key.getBytes(StandardCharsets.UTF_8).length > MAX_BYTES) {
			throw new IllegalArgumentException(INVALID);
		}
		return key;
	}

	/** s without the spaces and tabs around it. */
	private static String trim(String s) {
		int start = 0;
		int end = s.length();
		while (start < end && (s.charAt(start) == ' ' || s.charAt(start) == '\t')) {
			start++;
		}
		while (end > start && (s.charAt(end - 1) == ' ' || s.charAt(end - 1) == '\t')) {
			end--;
		}
		return s.substring(start, end);
	}

	/** The content of a whole sf-string, or null when s is not one (nothing may follow it). */
	private static String unquote(String s) {
		StringBuilder b = new StringBuilder();
		for (int i = 1; i < s.length(); i++) {
			char c = s.charAt(i);
			if (c == '\\') {
				i++;
				if (i == s.length() || (s.charAt(i) != '"' && s.charAt(i) != '\\')) {
					return null;
				}
				b.append(s.charAt(i));
			} else if (c == '"') {
				return i == s.length() - 1 ? b.toString() : null;
			} else if (c < 0x20 || c > 0x7e) {
				return null;
			} else {
				b.append(c);
			}
		}
		return null;
	}

	/** Whether s is made of tchar, ':' and '/' only, and does not start with ':'. */
	private static boolean isBare(String s) {
		if (s.isEmpty() || s.charAt(0) == ':') {
			return false;
		}
		for (int i = 0; i < s.length(); i++) {
			char c = s.charAt(i);
			boolean alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
			if (!alnum && "!#$%&'*+-.^_`|~:/".indexOf(c) < 0) {
				return false;
			}
		}
		return true;
	}
}
