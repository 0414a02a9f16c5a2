package io.github.idempotency;

import java.time.Duration;
import java.time.OffsetDateTime;
import java.util.List;
import java.util.Map;

/**
 * A key's record as {@link Idempotency#lookup} shows it: every column but the fence.
 *
 * @param scope the record's scope
 * @param key the record's key
 * @param fingerprint the hash of the request that claimed it
 * @param state {@code in_progress} or {@code completed}
 * @param attempt 1, or more after takeovers
 * @param lease the lease length of the claim; null once completed
 * @param leaseExpiresAt when the lease ends; null once completed
 * @param recoveryPoint what the owner checkpointed, or null
 * @param recoveryState its state as JSON text, or null
 * @param statusCode the stored status; null while in progress
 * @param headers the stored headers; empty when none
 * @param body the stored body; null when none
 * @param createdAt when the key was first claimed
 * @param completedAt when it completed; null while in progress
 * @param expiresAt when the record expires
 */
public record KeyRecord(String scope, String key, byte[] fingerprint, String state, int attempt, Duration lease,
		OffsetDateTime leaseExpiresAt, String recoveryPoint, String recoveryState, Integer statusCode,
		Map<String, List<String>> headers, byte[] body, OffsetDateTime createdAt, OffsetDateTime completedAt,
		OffsetDateTime expiresAt) {
}
