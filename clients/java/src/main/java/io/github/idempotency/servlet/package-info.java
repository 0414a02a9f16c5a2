/**
 * The Jakarta Servlet filter of the HTTP contract: {@link io.github.idempotency.servlet.IdempotencyFilter}.
 */
package io.github.idempotency.servlet;
