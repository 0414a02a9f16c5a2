/**
 * The idempotent function: any unit of work (a job, a webhook's effect, a call) run once per key, its
 * writes committed with its stored result. {@link io.github.idempotency.function.IdempotentFunction#run}
 * is the JDBC call; the Spring annotation {@link io.github.idempotency.spring.Idempotent} wraps a bean
 * method in it.
 */
package io.github.idempotency.function;
