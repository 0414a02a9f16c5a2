package io.github.idempotency.function;

import io.github.idempotency.ClaimResult;
import java.sql.Connection;
import java.sql.SQLException;
import java.util.function.Supplier;

/**
 * The run of an idempotent function in progress on this thread ({@link IdempotentFunction#current}):
 * which attempt it is, what an earlier attempt checkpointed, and {@link #checkpoint}.
 */
public final class IdempotentRun {
	private final ClaimResult.New claim;
	private final Supplier<Connection> checkpointConnection;
	private final boolean oneTransaction;

	IdempotentRun(ClaimResult.New claim, Supplier<Connection> checkpointConnection, boolean oneTransaction) {
		this.claim = claim;
		this.checkpointConnection = checkpointConnection;
		this.oneTransaction = oneTransaction;
	}

	/**
	 * The key.
	 *
	 * @return the key
	 */
	public String key() {
		return claim.key();
	}

	/**
	 * The scope.
	 *
	 * @return the scope
	 */
	public String scope() {
		return claim.scope();
	}

	/**
	 * 1, or more when this run takes over from one whose lease ended.
	 *
	 * @return the attempt
	 */
	public int attempt() {
		return claim.attempt();
	}

	/**
	 * What the last attempt checkpointed; null for none.
	 *
	 * @return the recovery point
	 */
	public String recoveryPoint() {
		return claim.recoveryPoint();
	}

	/**
	 * The state the last attempt checkpointed, as JSON text; null for none.
	 *
	 * @return the recovery state
	 */
	public String recoveryState() {
		return claim.recoveryState();
	}

	/**
	 * Records a recovery point, and renews the lease. With two transactions it commits at once (the work
	 * that calls out records how far it got); with one it commits with the result.
	 *
	 * @param recoveryPoint where the work is
	 * @param recoveryStateJson what it needs to go on, as JSON text; null for none
	 * @throws SQLException {@link io.github.idempotency.ClaimLostException} when another run took the key
	 */
	public void checkpoint(String recoveryPoint, String recoveryStateJson) throws SQLException {
		if (oneTransaction) {
			claim.checkpoint(checkpointConnection.get(), recoveryPoint, recoveryStateJson);
			return;
		}
		try (Connection db = checkpointConnection.get()) {
			db.setAutoCommit(true);
			claim.checkpoint(db, recoveryPoint, recoveryStateJson);
		}
	}
}
