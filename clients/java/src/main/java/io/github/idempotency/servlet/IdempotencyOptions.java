package io.github.idempotency.servlet;

import io.github.idempotency.Telemetry;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.trace.Tracer;
import jakarta.servlet.http.HttpServletRequest;
import java.time.Duration;
import java.util.List;
import java.util.Objects;
import java.util.function.Function;

/** How {@link IdempotencyFilter} behaves; the defaults follow the HTTP contract. */
public final class IdempotencyOptions {
	private List<String> methods = List.of("POST", "PATCH");
	private boolean keyOptional;
	private boolean failOpen;
	private Duration lease;
	private Duration retention;
	private List<String> storeHeaders = List.of("Content-Type", "Location");
	private int maxBodyBytes = 1 << 20;
	private Function<HttpServletRequest, String> scope = IdempotencyFilter::callerScope;
	private int claimTries = 4;
	private Duration retryDelay = Duration.ofMillis(50);
	private Tracer tracer;
	private boolean oneTransaction;
	private boolean prepare;
	private Duration claimWait;
	private KeySource key;
	private Verifier verify;
	private Redactor redact;

	/** Where a request's key is: {@link Webhooks#standard} and {@link Webhooks#bodyKey} give some. */
	@FunctionalInterface
	public interface KeySource {
		/**
		 * The key of a request.
		 *
		 * @param request the request
		 * @param body its body, read whole
		 * @return the key; null when the request has none
		 * @throws IllegalArgumentException when the key is malformed (400)
		 */
		String key(HttpServletRequest request, byte[] body);
	}

	/** Checks that a request is authentic (a webhook's signature) before anything is claimed. */
	@FunctionalInterface
	public interface Verifier {
		/**
		 * Checks the request.
		 *
		 * @param request the request
		 * @param body its body, read whole
		 * @throws Exception when it is not authentic: 401, nothing claimed
		 */
		void verify(HttpServletRequest request, byte[] body) throws Exception;
	}

	/** What is stored of a response: the live response is sent as the handler made it. */
	@FunctionalInterface
	public interface Redactor {
		/**
		 * The response as a replay will send it.
		 *
		 * @param status the status
		 * @param headers the headers the filter would store (a name to its values)
		 * @param body the body
		 * @return what to store
		 */
		Stored redact(int status, java.util.Map<String, List<String>> headers, byte[] body);
	}

	/**
	 * A response as stored.
	 *
	 * @param status the status (a 5xx is not stored)
	 * @param headers the headers
	 * @param body the body
	 */
	public record Stored(int status, java.util.Map<String, List<String>> headers, byte[] body) {
	}

	/** @return the methods that take a key (default POST, PATCH) */
	public List<String> methods() {
		return methods;
	}

	/**
	 * @param methods the methods that take a key
	 * @return this
	 */
	public IdempotencyOptions methods(List<String> methods) {
		this.methods = List.copyOf(methods);
		return this;
	}

	/** @return whether a request without a key runs unguarded instead of answering 400 */
	public boolean keyOptional() {
		return keyOptional;
	}

	/**
	 * @param keyOptional run a request without a key unguarded (default false: 400)
	 * @return this
	 */
	public IdempotencyOptions keyOptional(boolean keyOptional) {
		this.keyOptional = keyOptional;
		return this;
	}

	/** @return whether a failed claim runs the handler unguarded instead of answering 503 */
	public boolean failOpen() {
		return failOpen;
	}

	/**
	 * @param failOpen run the handler unguarded when the claim fails (default false: 503)
	 * @return this
	 */
	public IdempotencyOptions failOpen(boolean failOpen) {
		this.failOpen = failOpen;
		return this;
	}

	/** @return the lease, null for {@code idempotency.lease} */
	public Duration lease() {
		return lease;
	}

	/**
	 * @param lease longer than the slowest handler; null: {@code idempotency.lease} (60 s)
	 * @return this
	 */
	public IdempotencyOptions lease(Duration lease) {
		this.lease = positive(lease, "lease");
		return this;
	}

	/** @return the retention, null for {@code idempotency.retention} */
	public Duration retention() {
		return retention;
	}

	/**
	 * @param retention how long answers are replayed; null: {@code idempotency.retention} (24 h)
	 * @return this
	 */
	public IdempotencyOptions retention(Duration retention) {
		this.retention = positive(retention, "retention");
		return this;
	}

	/** @return the response headers a replay repeats */
	public List<String> storeHeaders() {
		return storeHeaders;
	}

	/**
	 * @param storeHeaders the response headers a replay repeats (default Content-Type, Location);
	 *     Content-Encoding is always kept with the body it describes
	 * @return this
	 */
	public IdempotencyOptions storeHeaders(List<String> storeHeaders) {
		this.storeHeaders = List.copyOf(storeHeaders);
		return this;
	}

	/** @return the largest request body read, in bytes */
	public int maxBodyBytes() {
		return maxBodyBytes;
	}

	/**
	 * @param maxBodyBytes the largest request body (default 1 MiB); a larger one is answered 413
	 * @return this
	 */
	public IdempotencyOptions maxBodyBytes(int maxBodyBytes) {
		if (maxBodyBytes < 0) {
			throw new IllegalArgumentException("maxBodyBytes must not be negative");
		}
		this.maxBodyBytes = maxBodyBytes;
		return this;
	}

	/** @return whose keys a request's are */
	public Function<HttpServletRequest, String> scope() {
		return scope;
	}

	/**
	 * @param scope whose keys: your tenant or account id if you have one (default
	 *     {@link IdempotencyFilter#callerScope})
	 * @return this
	 */
	public IdempotencyOptions scope(Function<HttpServletRequest, String> scope) {
		this.scope = Objects.requireNonNull(scope, "scope");
		return this;
	}

	/** @return how many times a claim without an answer is asked in all */
	public int claimTries() {
		return claimTries;
	}

	/**
	 * @param claimTries how many times a claim without an answer is asked in all (default 4)
	 * @return this
	 */
	public IdempotencyOptions claimTries(int claimTries) {
		if (claimTries < 1) {
			throw new IllegalArgumentException("claimTries must be at least 1");
		}
		this.claimTries = claimTries;
		return this;
	}

	/** @return the first wait before a claim is asked again (doubled each time) */
	public Duration retryDelay() {
		return retryDelay;
	}

	/**
	 * @param retryDelay the first wait before a claim is asked again, doubled each time (default 50 ms)
	 * @return this
	 */
	public IdempotencyOptions retryDelay(Duration retryDelay) {
		this.retryDelay = Objects.requireNonNull(retryDelay, "retryDelay");
		return this;
	}

	/** @return where the spans go; null: the global OpenTelemetry's, looked up at each request */
	public Tracer tracer() {
		return tracer;
	}

	/**
	 * @param tracer where the spans go (default null: the global OpenTelemetry's)
	 * @return this
	 */
	public IdempotencyOptions tracer(Tracer tracer) {
		this.tracer = tracer;
		return this;
	}

	/**
	 * @param openTelemetry whose tracer the spans go to (default: the global OpenTelemetry)
	 * @return this
	 */
	public IdempotencyOptions openTelemetry(OpenTelemetry openTelemetry) {
		this.tracer = Telemetry.tracer(openTelemetry);
		return this;
	}

	/** @return whether the claim is in the handler's transaction */
	public boolean oneTransaction() {
		return oneTransaction;
	}

	/**
	 * @param oneTransaction the claim, the handler's writes and complete in one transaction (default
	 *     false: the claim commits on its own first), for handlers whose effects are all in this database
	 * @return this
	 */
	public IdempotencyOptions oneTransaction(boolean oneTransaction) {
		this.oneTransaction = oneTransaction;
		return this;
	}

	/** @return whether the filter's statements are named server-side statements, prepared once per connection */
	public boolean prepare() {
		return prepare;
	}

	/**
	 * @param prepare send claim, complete and release as named server-side statements, parsed and planned
	 *     once per connection (default false: unnamed, parsed and planned on every call, which works
	 *     through any transaction pooler); only on direct connections or through a pooler that keeps
	 *     prepared statements (PgBouncer 1.21 or later with {@code max_prepared_statements})
	 * @return this
	 */
	public IdempotencyOptions prepare(boolean prepare) {
		this.prepare = prepare;
		return this;
	}

	/**
	 * @return how long a duplicate waits for the request it repeats before 409: what was set, else 2 s
	 *     with {@link #oneTransaction}, else null (no wait)
	 */
	public Duration claimWait() {
		return claimWait != null ? claimWait : oneTransaction ? Duration.ofSeconds(2) : null;
	}

	/**
	 * @param claimWait how long a duplicate waits for the request it repeats before answering 409
	 *     (claim's {@code wait}); default none, 2 s with {@link #oneTransaction}
	 * @return this
	 */
	public IdempotencyOptions claimWait(Duration claimWait) {
		this.claimWait = positive(claimWait, "claimWait");
		return this;
	}

	/** d, refused when zero or negative. */
	private static Duration positive(Duration d, String name) {
		if (d != null && (d.isZero() || d.isNegative())) {
			throw new IllegalArgumentException(name + " must be positive");
		}
		return d;
	}

	/** @return where the key is read from; null: the Idempotency-Key header */
	public KeySource key() {
		return key;
	}

	/**
	 * @param key where the key is read from (a webhook's id); null (the default): the Idempotency-Key
	 *     header
	 * @return this
	 */
	public IdempotencyOptions key(KeySource key) {
		this.key = key;
		return this;
	}

	/** @return what checks a request before its claim; null for nothing */
	public Verifier verify() {
		return verify;
	}

	/**
	 * @param verify checks each covered request before its claim (a webhook's signature): a request it
	 *     refuses is answered 401 and nothing is claimed
	 * @return this
	 */
	public IdempotencyOptions verify(Verifier verify) {
		this.verify = verify;
		return this;
	}

	/** @return what turns a response into what is stored; null: stored as sent */
	public Redactor redact() {
		return redact;
	}

	/**
	 * @param redact given the status, the headers to store and the body, returns what to store (a card
	 *     number masked): the live response is unchanged, a replay sends what was stored; one that throws
	 *     is answered 500 {@code idempotency_redact_failed}: nothing stored, the handler's work rolled
	 *     back, the key released
	 * @return this
	 */
	public IdempotencyOptions redact(Redactor redact) {
		this.redact = redact;
		return this;
	}
}
