package io.github.idempotency.function;

import io.github.idempotency.Telemetry;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.trace.Tracer;
import java.lang.reflect.Type;
import java.time.Duration;
import java.util.Arrays;
import java.util.List;
import java.util.Objects;
import java.util.function.Predicate;

/**
 * The options of an idempotent function: its result's type, the arguments that identify the unit of
 * work, the scope, the transaction mode, the durations. Start with {@link #of(Class)}; each setter returns
 * this.
 *
 * @param <T> the result's type
 */
public final class FunctionOptions<T> {
	private final Type resultType;
	private String scope = "";
	private List<Object> args = List.of();
	private boolean oneTransaction = true;
	private Duration lease;
	private Duration retention;
	private Duration waitFor = Duration.ofSeconds(2);
	private Duration extendEvery;
	private Predicate<Throwable> finalErrors = e -> false;
	private int claimTries = 3;
	private Duration retryDelay = Duration.ofMillis(50);
	private Tracer tracer;

	private FunctionOptions(Type resultType) {
		this.resultType = Objects.requireNonNull(resultType, "resultType");
	}

	/**
	 * Options of a function whose result is of type {@code resultType}.
	 *
	 * @param <T> the type
	 * @param resultType its class ({@code Void.class} for none)
	 * @return the options
	 */
	public static <T> FunctionOptions<T> of(Class<T> resultType) {
		return new FunctionOptions<>(resultType);
	}

	/**
	 * Options of a function whose result is of a generic type (a {@code List<Charge>}: the method's
	 * {@link java.lang.reflect.Method#getGenericReturnType()}).
	 *
	 * @param <T> the type
	 * @param resultType the type
	 * @return the options
	 */
	public static <T> FunctionOptions<T> ofType(Type resultType) {
		return new FunctionOptions<>(resultType);
	}

	/**
	 * Whose unit of work it is (a tenant, a sender); {@code ""} (the default) is unscoped.
	 *
	 * @param scope the scope
	 * @return this
	 */
	public FunctionOptions<T> scope(String scope) {
		this.scope = Objects.requireNonNull(scope, "scope");
		return this;
	}

	/**
	 * The arguments of the unit of work: their canonical JSON's SHA-256 is the fingerprint, so that the
	 * key used again with other arguments is refused ({@link IdempotentCallException.Mismatch}).
	 *
	 * @param args the arguments (serializable by Jackson)
	 * @return this
	 */
	public FunctionOptions<T> args(Object... args) {
		this.args = Arrays.asList(args.clone());
		return this;
	}

	/**
	 * One transaction (the default): the claim, the work's writes and the result commit together. False:
	 * the claim commits first and the lease is renewed while the work runs, for work that calls out of
	 * the database (its recovery points then commit at once).
	 *
	 * @param oneTransaction the mode
	 * @return this
	 */
	public FunctionOptions<T> oneTransaction(boolean oneTransaction) {
		this.oneTransaction = oneTransaction;
		return this;
	}

	/**
	 * The lease; null (the default): the setting idempotency.lease.
	 *
	 * @param lease the lease
	 * @return this
	 */
	public FunctionOptions<T> lease(Duration lease) {
		this.lease = lease;
		return this;
	}

	/**
	 * How long the result is kept; null (the default): the setting idempotency.retention.
	 *
	 * @param retention the retention
	 * @return this
	 */
	public FunctionOptions<T> retention(Duration retention) {
		this.retention = retention;
		return this;
	}

	/**
	 * How long a duplicate waits for the run in progress before {@link IdempotentCallException.InProgress}
	 * (default 2 s; null or zero: not at all).
	 *
	 * @param waitFor the wait
	 * @return this
	 */
	public FunctionOptions<T> waitFor(Duration waitFor) {
		this.waitFor = waitFor;
		return this;
	}

	/**
	 * Two transactions: how often the lease is renewed while the work runs; null (the default): a third
	 * of the lease.
	 *
	 * @param extendEvery the period
	 * @return this
	 */
	public FunctionOptions<T> extendEvery(Duration extendEvery) {
		this.extendEvery = extendEvery;
		return this;
	}

	/**
	 * Which errors are final: stored, and given back to duplicates as {@link
	 * IdempotentCallException.Stored}, instead of releasing the key. None by default.
	 *
	 * @param finalErrors the test
	 * @return this
	 */
	public FunctionOptions<T> finalErrors(Predicate<Throwable> finalErrors) {
		this.finalErrors = Objects.requireNonNull(finalErrors, "finalErrors");
		return this;
	}

	/**
	 * How many times a claim whose answer was lost is asked in all (default 3), the first ask again after
	 * retryDelay (default 50 ms), doubled each time.
	 *
	 * @param claimTries the tries, at least 1
	 * @param retryDelay the first delay
	 * @return this
	 */
	public FunctionOptions<T> claimTries(int claimTries, Duration retryDelay) {
		if (claimTries < 1) {
			throw new IllegalArgumentException("claimTries must be at least 1");
		}
		this.claimTries = claimTries;
		this.retryDelay = Objects.requireNonNull(retryDelay, "retryDelay");
		return this;
	}

	/**
	 * Where the spans go (default: the global OpenTelemetry's).
	 *
	 * @param openTelemetry the application's OpenTelemetry
	 * @return this
	 */
	public FunctionOptions<T> openTelemetry(OpenTelemetry openTelemetry) {
		this.tracer = Telemetry.tracer(openTelemetry);
		return this;
	}

	Type resultType() {
		return resultType;
	}

	String scope() {
		return scope;
	}

	List<Object> args() {
		return args;
	}

	boolean oneTransaction() {
		return oneTransaction;
	}

	Duration lease() {
		return lease;
	}

	Duration retention() {
		return retention;
	}

	Duration waitFor() {
		return waitFor;
	}

	Duration extendEvery() {
		return extendEvery;
	}

	boolean isFinal(Throwable e) {
		return finalErrors.test(e);
	}

	int claimTries() {
		return claimTries;
	}

	Duration retryDelay() {
		return retryDelay;
	}

	Tracer tracer() {
		return tracer;
	}
}
