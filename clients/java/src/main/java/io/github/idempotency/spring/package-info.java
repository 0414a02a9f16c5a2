/**
 * Spring Boot auto-configuration of the filter: {@link io.github.idempotency.spring.IdempotencyAutoConfiguration},
 * the {@code idempotency.*} properties.
 */
package io.github.idempotency.spring;
