/**
 * A client for the idempotency PostgreSQL extension: {@link io.github.idempotency.Idempotency} (claim,
 * lookup, fingerprint), {@link io.github.idempotency.ClaimResult} and its owner operations, the SQLSTATEs
 * as exceptions. The HTTP layer is in {@code io.github.idempotency.servlet}, Spring Boot's
 * auto-configuration in {@code io.github.idempotency.spring}.
 */
package io.github.idempotency;
