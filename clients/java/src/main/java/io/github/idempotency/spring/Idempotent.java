package io.github.idempotency.spring;

import java.lang.annotation.Documented;
import java.lang.annotation.ElementType;
import java.lang.annotation.Retention;
import java.lang.annotation.RetentionPolicy;
import java.lang.annotation.Target;

/**
 * Runs a Spring bean's method once per key, as {@link io.github.idempotency.function.IdempotentFunction}
 * does: its JdbcTemplate, JdbcClient and JPA writes commit with its stored result (a transaction of the
 * application's transaction manager, a new one), a duplicate call gets that result back (as the method's
 * return type) without running. The method's arguments are the fingerprint.
 *
 * <pre>{@code
 * @Idempotent(key = "#event.id", scope = "'billing'")
 * public Charge charge(PaymentEvent event) { ... }
 * }</pre>
 */
@Target(ElementType.METHOD)
@Retention(RetentionPolicy.RUNTIME)
@Documented
public @interface Idempotent {
	/**
	 * The key: a SpEL expression over the method's parameters ({@code #orderId}, {@code #event.id}).
	 *
	 * @return the expression
	 */
	String key();

	/**
	 * The scope: a SpEL expression; empty (the default): unscoped.
	 *
	 * @return the expression
	 */
	String scope() default "";

	/**
	 * Whether the claim commits with the work (true, the default), or first, with the lease renewed while
	 * the method runs (for a method that calls out).
	 *
	 * @return the mode
	 */
	boolean oneTransaction() default true;

	/**
	 * The lease ("30s", "5m"); empty: the setting idempotency.lease.
	 *
	 * @return the duration
	 */
	String lease() default "";

	/**
	 * How long the result is kept ("24h"); empty: the setting idempotency.retention.
	 *
	 * @return the duration
	 */
	String retention() default "";

	/**
	 * How long a duplicate waits for the run in progress ("2s", the default; "0s": not at all).
	 *
	 * @return the duration
	 */
	String waitFor() default "2s";

	/**
	 * The errors that are final: stored and given back to duplicates (as
	 * {@link io.github.idempotency.function.IdempotentCallException.Stored}) instead of releasing the key.
	 *
	 * @return the classes (and their subclasses)
	 */
	Class<? extends Throwable>[] finalErrors() default {};
}
