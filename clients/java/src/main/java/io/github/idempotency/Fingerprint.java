package io.github.idempotency;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;

/**
 * The extension's request fingerprint, computed in Java: {@code idempotency.fingerprint(method, path,
 * body, query)} returns the same bytes.
 */
public final class Fingerprint {
	private Fingerprint() {
	}

	/**
	 * The SHA-256 of the request's parts, each written as a presence byte, an 8-byte big-endian length
	 * and its bytes (UTF-8 for text). The method is upper-cased (ASCII letters only, as the extension
	 * does). A null body or query is absent (SQL NULL), which differs from an empty one.
	 *
	 * @param method the HTTP method, any case
	 * @param path the path, without the query
	 * @param body the raw body, null for none
	 * @param query the query string without its '?', null for none
	 * @return 32 bytes
	 */
	public static byte[] of(String method, String path, byte[] body, String query) {
		MessageDigest sha = sha256();
		part(sha, asciiUpper(method).getBytes(StandardCharsets.UTF_8));
		part(sha, path.getBytes(StandardCharsets.UTF_8));
		part(sha, body);
		part(sha, query == null ? null : query.getBytes(StandardCharsets.UTF_8));
		return sha.digest();
	}

	/** Feeds one part, or its absence (null), to sha. */
	private static void part(MessageDigest sha, byte[] data) {
		ByteBuffer header = ByteBuffer.allocate(9);
		if (data != null) {
			header.put((byte) 1).putLong(data.length);
		}
		sha.update(header.array());
		if (data != null) {
			sha.update(data);
		}
	}

	/** Upper-cases a-z only, leaving every other character as it is. */
	private static String asciiUpper(String s) {
		StringBuilder b = new StringBuilder(s.length());
		for (int i = 0; i < s.length(); i++) {
			char c = s.charAt(i);
			b.append(c >= 'a' && c <= 'z' ? (char) (c - ('a' - 'A')) : c);
		}
		return b.toString();
	}

	/** A SHA-256 digest, which every Java platform has. */
	static MessageDigest sha256() {
		try {
			return MessageDigest.getInstance("SHA-256");
		} catch (NoSuchAlgorithmException e) {
			throw new IllegalStateException("SHA-256 is missing from this Java platform", e);
		}
	}
}
