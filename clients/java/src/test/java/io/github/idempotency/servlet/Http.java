package io.github.idempotency.servlet;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/**
 * A bare HTTP/1.1 client for the tests: it sends header lines exactly as given (a field twice, an odd
 * value), which java.net.http would not.
 */
public final class Http {
	private Http() {
	}

	/** A response: status, header lines, body. */
	public record Response(int status, List<String[]> headers, byte[] body) {
		/** The first value of header name, or null. */
		public String header(String name) {
			for (String[] h : headers) {
				if (h[0].equalsIgnoreCase(name)) {
					return h[1];
				}
			}
			return null;
		}

		/** The body as UTF-8 text. */
		public String text() {
			return new String(body, StandardCharsets.UTF_8);
		}

		/** The problem's code, or null when the body is not a problem. */
		public String problemCode() {
			String type = header("Content-Type");
			if (type == null || !type.startsWith("application/problem+json")) {
				return null;
			}
			java.util.regex.Matcher m = java.util.regex.Pattern.compile("\"code\":\"([a-z_]+)\"").matcher(text());
			return m.find() ? m.group(1) : null;
		}
	}

	/** POSTs body to path on port with the credential and the Idempotency-Key lines given (none: no field). */
	public static Response post(int port, String path, String credential, String body, String... keys)
			throws IOException {
		List<String> lines = new ArrayList<>();
		if (credential != null) {
			lines.add("Authorization: " + credential);
		}
		for (String key : keys) {
			lines.add("Idempotency-Key: " + key);
		}
		lines.add("Content-Type: application/json");
		return send(port, "POST", path, lines, body.getBytes(StandardCharsets.UTF_8));
	}

	/** Sends one request and reads its response (Connection: close). */
	public static Response send(int port, String method, String path, List<String> headerLines, byte[] body)
			throws IOException {
		try (Socket s = new Socket("127.0.0.1", port)) {
			s.setSoTimeout(60_000);
			StringBuilder head = new StringBuilder(method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n"
					+ "Connection: close\r\nContent-Length: " + body.length + "\r\n");
			for (String line : headerLines) {
				head.append(line).append("\r\n");
			}
			OutputStream out = s.getOutputStream();
			out.write(head.append("\r\n").toString().getBytes(StandardCharsets.ISO_8859_1));
			out.write(body);
			out.flush();
			return read(s.getInputStream());
		}
	}

	/** Parses a whole response (Content-Length or chunked, or until the connection closes). */
	private static Response read(InputStream in) throws IOException {
		String status = line(in);
		int code = Integer.parseInt(status.split(" ")[1]);
		List<String[]> headers = new ArrayList<>();
		for (String line = line(in); !line.isEmpty(); line = line(in)) {
			int colon = line.indexOf(':');
			headers.add(new String[] {line.substring(0, colon), line.substring(colon + 1).trim()});
		}
		Response partial = new Response(code, headers, new byte[0]);
		String length = partial.header("Content-Length");
		String encoding = partial.header("Transfer-Encoding");
		ByteArrayOutputStream body = new ByteArrayOutputStream();
		if (encoding != null && encoding.toLowerCase(Locale.ROOT).contains("chunked")) {
			for (int size = Integer.parseInt(line(in).trim(), 16); size > 0; size = Integer.parseInt(line(in).trim(), 16)) {
				body.write(in.readNBytes(size));
				line(in);
			}
		} else if (length != null) {
			body.write(in.readNBytes(Integer.parseInt(length)));
		} else {
			body.write(in.readAllBytes());
		}
		return new Response(code, headers, body.toByteArray());
	}

	/** One CRLF-terminated line, without its CRLF. */
	private static String line(InputStream in) throws IOException {
		ByteArrayOutputStream b = new ByteArrayOutputStream();
		for (int c = in.read(); c != '\n'; c = in.read()) {
			if (c < 0) {
				throw new IOException("the connection closed mid-response");
			}
			if (c != '\r') {
				b.write(c);
			}
		}
		return b.toString(StandardCharsets.ISO_8859_1);
	}
}
