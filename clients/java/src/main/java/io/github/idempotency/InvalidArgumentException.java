package io.github.idempotency;

import java.sql.SQLException;

/**
 * The extension refused an argument: 22004 (a required one is null), 22023 (a key empty, over 255 bytes
 * or with control characters; a fingerprint, status code, interval or headers it refuses) or 54000 (a
 * response over {@code idempotency.max_response_bytes}). Nothing was written.
 */
public class InvalidArgumentException extends IdempotencyException {
	private static final long serialVersionUID = 1L;

	/**
	 * A refused argument of call {@code call}.
	 *
	 * @param call the function that failed
	 * @param cause the driver's error
	 */
	public InvalidArgumentException(String call, SQLException cause) {
		super(call, cause);
	}
}
