package io.github.idempotency.servlet;

/**
 * RecoveryIT's lost answers with the claim in the handler's transaction: a claim whose answer is lost
 * rolled back with its transaction and is asked again in another; a lost COMMIT is resolved with the
 * token (replay: it committed; new: nothing of it did, the claim neither, and the handler runs again);
 * 16 duplicates through a pool of 4 wait for the first and replay it.
 */
class OneTransactionRecoveryIT extends RecoveryIT {
	@Override
	IdempotencyOptions options() {
		return super.options().oneTransaction(true);
	}
}
