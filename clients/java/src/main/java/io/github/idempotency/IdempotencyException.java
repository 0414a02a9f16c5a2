package io.github.idempotency;

import java.sql.SQLException;

/**
 * An error of an idempotency call, with the server's SQLSTATE ({@link #getSQLState()}) and its error as
 * the cause. Subclasses name the SQLSTATEs that callers act on: {@link ClaimLostException} (IK001),
 * {@link InvalidArgumentException} (22004, 22023, 54000), {@link RetryableException} (40001, 55P03).
 * Other errors of the server (25006 in a read-only transaction, 42501 without a grant) come as this
 * class; a connection that failed comes as the driver's own {@link SQLException}.
 */
public class IdempotencyException extends SQLException {
	private static final long serialVersionUID = 1L;

	/**
	 * An error of call {@code call}.
	 *
	 * @param call the function that failed (claim, complete...)
	 * @param cause the driver's error
	 */
	public IdempotencyException(String call, SQLException cause) {
		super("idempotency." + call + ": " + cause.getMessage(), cause.getSQLState(), cause.getErrorCode(), cause);
	}

	/**
	 * The exception for the error of call {@code call}: one of the subclasses when its SQLSTATE has one,
	 * else an IdempotencyException; the driver's error itself when the connection failed (no SQLSTATE, or
	 * class 08 or 57P0x: the answer was lost, see {@link Idempotency#isConnectionLost}).
	 *
	 * @param call the function that failed
	 * @param e the driver's error
	 * @return what to throw
	 */
	public static SQLException of(String call, SQLException e) {
		if (e instanceof IdempotencyException || Idempotency.isConnectionLost(e)) {
			return e;
		}
		switch (e.getSQLState()) {
			case "IK001": return new ClaimLostException(call, e);
			case "22004": case "22023": case "54000": return new InvalidArgumentException(call, e);
			case "40001": case "55P03": return new RetryableException(call, e);
			default: return new IdempotencyException(call, e);
		}
	}
}
