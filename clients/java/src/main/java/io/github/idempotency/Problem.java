package io.github.idempotency;

import java.nio.charset.StandardCharsets;

/**
 * An RFC 9457 problem of the HTTP contract ({@code application/problem+json}): the answers the
 * middleware gives instead of the handler's.
 *
 * @param status the HTTP status
 * @param code the stable machine-readable name ({@code idempotency_key_missing}...)
 * @param detail one sentence for a human
 * @param retryAfter the Retry-After seconds, 0 for none
 */
public record Problem(int status, String code, String detail, int retryAfter) {
	/** The media type of a problem. */
	public static final String CONTENT_TYPE = "application/problem+json";

	/**
	 * 400 {@code idempotency_key_missing}.
	 *
	 * @return the problem
	 */
	public static Problem keyMissing() {
		return new Problem(400, "idempotency_key_missing", "the Idempotency-Key header is required", 0);
	}

	/**
	 * 400 {@code idempotency_key_invalid}.
	 *
	 * @param detail why
	 * @return the problem
	 */
	public static Problem keyInvalid(String detail) {
		return new Problem(400, "idempotency_key_invalid", detail, 0);
	}

	/**
	 * 409 {@code idempotency_key_in_progress}.
	 *
	 * @param retryAfter seconds until the lease ends
	 * @return the problem
	 */
	public static Problem inProgress(int retryAfter) {
		return new Problem(409, "idempotency_key_in_progress",
				"a request with this Idempotency-Key is still in progress; retry after Retry-After seconds",
				Math.max(1, retryAfter));
	}

	/**
	 * 422 {@code idempotency_key_mismatch}.
	 *
	 * @return the problem
	 */
	public static Problem mismatch() {
		return new Problem(422, "idempotency_key_mismatch",
				"this Idempotency-Key was used with a different request", 0);
	}

	/**
	 * 409 {@code idempotency_claim_lost}.
	 *
	 * @return the problem
	 */
	public static Problem claimLost() {
		return new Problem(409, "idempotency_claim_lost",
				"this request ran past its lease and a retry took it over; its work was undone", 1);
	}

	/**
	 * 503 {@code idempotency_unavailable}: nothing ran.
	 *
	 * @return the problem
	 */
	public static Problem unavailable() {
		return new Problem(503, "idempotency_unavailable",
				"the idempotency store is unavailable and this request was not carried out; retry later", 1);
	}

	/**
	 * 500 {@code idempotency_redact_failed}: the redact option threw; nothing was stored, the handler's
	 * work rolled back and the key was released.
	 *
	 * @return the problem
	 */
	public static Problem redactFailed() {
		return new Problem(500, "idempotency_redact_failed",
				"the response could not be redacted for storing; nothing of it was kept", 0);
	}

	/**
	 * 503 {@code idempotency_unavailable}, one transaction: a claim asked again after its answer was
	 * lost found the key still held, most likely by that lost claim's own transaction (it never
	 * commits, and lasts until the server learns its connection is gone). Nothing of it was kept.
	 *
	 * @param retryAfter seconds the claim said to wait
	 * @return the problem
	 */
	public static Problem claimHeld(int retryAfter) {
		return new Problem(503, "idempotency_unavailable",
				"the connection to the idempotency store was lost while this request was claimed; "
						+ "nothing of it was kept; retry later", Math.max(1, retryAfter));
	}

	/**
	 * 503 {@code idempotency_unavailable}: whether the request took effect is not known.
	 *
	 * @return the problem
	 */
	public static Problem unknown() {
		return new Problem(503, "idempotency_unavailable",
				"the idempotency store did not say whether this request was done; "
						+ "retry with the same Idempotency-Key to get its answer", 1);
	}

	/**
	 * The status's reason phrase (RFC 9110), the problem's title.
	 *
	 * @return the title
	 */
	public String title() {
		switch (status) {
			case 400: return "Bad Request";
			case 401: return "Unauthorized";
			case 409: return "Conflict";
			case 413: return "Content Too Large";
			case 422: return "Unprocessable Content";
			case 500: return "Internal Server Error";
			case 503: return "Service Unavailable";
			default: return "Error";
		}
	}

	/**
	 * The body: {@code type}, {@code title}, {@code status}, {@code detail} and {@code code}.
	 *
	 * @return UTF-8 JSON
	 */
	public byte[] toJson() {
		StringBuilder b = new StringBuilder("{\"type\":\"about:blank\",\"title\":");
		Json.quote(b, title()).append(",\"status\":").append(status).append(",\"detail\":");
		Json.quote(b, detail).append(",\"code\":");
		Json.quote(b, code).append('}');
		return b.toString().getBytes(StandardCharsets.UTF_8);
	}
}
