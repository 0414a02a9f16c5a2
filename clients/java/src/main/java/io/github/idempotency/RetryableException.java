package io.github.idempotency;

import java.sql.SQLException;

/**
 * The call may succeed if asked again in a new transaction: 40001 (under REPEATABLE READ or SERIALIZABLE,
 * the snapshot could not see what committed on the key) or 55P03 ({@code lock_timeout} ended a wait).
 */
public class RetryableException extends IdempotencyException {
	private static final long serialVersionUID = 1L;

	/**
	 * A retryable error of call {@code call}.
	 *
	 * @param call the function that failed
	 * @param cause the driver's error
	 */
	public RetryableException(String call, SQLException cause) {
		super(call, cause);
	}
}
