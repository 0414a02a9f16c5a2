package io.github.idempotency;

import java.time.Duration;
import java.util.Objects;
import java.util.UUID;

/**
 * The arguments of a claim. Build one with {@link #of} and the {@code with...} methods; a null
 * duration leaves the extension's setting ({@code idempotency.lease}, {@code idempotency.retention})
 * in force, and a null wait answers at once.
 *
 * @param scope whose key: an account, a tenant, a hash of the credential; {@code ""} is unscoped
 * @param key the client's Idempotency-Key, 1 to 255 bytes
 * @param fingerprint the request's hash ({@link Fingerprint#of}), 1 to 64 bytes
 * @param lease how long the owner may work before a retry takes over; null: the setting
 * @param retention how long the answer is replayed; null: the setting
 * @param waitFor how long to wait for an owner in progress; null or zero: answer at once
 * @param token this attempt's id (one per incoming request), so that a claim whose answer was lost can
 *     be asked again; null for none
 * @param prepared whether the claim, and the calls of the {@code New} it returns, are named server-side
 *     statements, prepared once per connection (only on a direct connection, or through a pooler that
 *     keeps prepared statements: PgBouncer 1.21 or later with {@code max_prepared_statements}); false:
 *     unnamed, parsed and planned on each call, which works through any pooler
 */
public record ClaimRequest(String scope, String key, byte[] fingerprint, Duration lease, Duration retention,
		Duration waitFor, UUID token, boolean prepared) {

	/** Checks that scope and key are given (a null fingerprint is left to the database: 22004). */
	public ClaimRequest {
		Objects.requireNonNull(scope, "scope");
		Objects.requireNonNull(key, "key");
	}

	/**
	 * A claim sent as unnamed statements.
	 *
	 * @param scope whose key
	 * @param key the Idempotency-Key
	 * @param fingerprint the request's hash
	 * @param lease the lease, null for the setting
	 * @param retention the retention, null for the setting
	 * @param waitFor the longest wait, null for none
	 * @param token the token, null for none
	 */
	public ClaimRequest(String scope, String key, byte[] fingerprint, Duration lease, Duration retention,
			Duration waitFor, UUID token) {
		this(scope, key, fingerprint, lease, retention, waitFor, token, false);
	}

	/**
	 * A claim of key in scope for the request that fingerprint identifies, with the settings' lease and
	 * retention, no wait and no token.
	 *
	 * @param scope whose key ({@code ""}: unscoped)
	 * @param key the Idempotency-Key
	 * @param fingerprint the request's hash
	 * @return the request
	 */
	public static ClaimRequest of(String scope, String key, byte[] fingerprint) {
		return new ClaimRequest(scope, key, fingerprint, null, null, null, null);
	}

	/**
	 * This claim with another lease.
	 *
	 * @param lease the lease, null for the setting
	 * @return a copy
	 */
	public ClaimRequest withLease(Duration lease) {
		return new ClaimRequest(scope, key, fingerprint, lease, retention, waitFor, token, prepared);
	}

	/**
	 * This claim with another retention.
	 *
	 * @param retention the retention, null for the setting
	 * @return a copy
	 */
	public ClaimRequest withRetention(Duration retention) {
		return new ClaimRequest(scope, key, fingerprint, lease, retention, waitFor, token, prepared);
	}

	/**
	 * This claim, waiting up to {@code waitFor} for an owner in progress.
	 *
	 * @param waitFor the longest wait, null for none
	 * @return a copy
	 */
	public ClaimRequest withWait(Duration waitFor) {
		return new ClaimRequest(scope, key, fingerprint, lease, retention, waitFor, token, prepared);
	}

	/**
	 * This claim with a token ({@link Idempotency#newToken()}, one per incoming request).
	 *
	 * @param token the token, null for none
	 * @return a copy
	 */
	public ClaimRequest withToken(UUID token) {
		return new ClaimRequest(scope, key, fingerprint, lease, retention, waitFor, token, prepared);
	}

	/**
	 * This claim, sent as named server-side statements prepared once per connection, or not.
	 *
	 * @param prepared true: named statements (a direct connection, or a pooler that keeps them)
	 * @return a copy
	 */
	public ClaimRequest withPrepared(boolean prepared) {
		return new ClaimRequest(scope, key, fingerprint, lease, retention, waitFor, token, prepared);
	}
}
