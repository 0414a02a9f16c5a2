package io.github.idempotency;

import java.sql.SQLException;

/**
 * IK001: the fence no longer owns the claim (its lease ended and a retry took it over, or it was
 * released or reaped), so it may not complete, extend or checkpoint it. Raised inside a transaction, it
 * means that transaction must roll back.
 */
public class ClaimLostException extends IdempotencyException {
	private static final long serialVersionUID = 1L;

	/**
	 * IK001 from call {@code call}.
	 *
	 * @param call the function that failed
	 * @param cause the driver's error
	 */
	public ClaimLostException(String call, SQLException cause) {
		super(call, cause);
	}
}
