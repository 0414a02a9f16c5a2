package io.github.idempotency.spring;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import org.springframework.boot.context.properties.ConfigurationProperties;
import org.springframework.util.unit.DataSize;

/**
 * The {@code idempotency.*} properties of the Spring Boot auto-configuration.
 */
@ConfigurationProperties("idempotency")
public class IdempotencyProperties {
	/** Whether to register the filter. */
	private boolean enabled = true;
	/** The methods that take an Idempotency-Key. */
	private List<String> methods = new ArrayList<>(List.of("POST", "PATCH"));
	/** The URL patterns the filter covers. */
	private List<String> urlPatterns = new ArrayList<>(List.of("/*"));
	/** The filter's order: after Spring Security (-100), so that the principal is known. */
	private int filterOrder = 0;
	/** Run a request without a key unguarded instead of answering 400. */
	private boolean keyOptional;
	/** Run the handler unguarded instead of answering 503 when the claim fails. */
	private boolean failOpen;
	/** How long a handler may run before a retry takes over; unset: the database's idempotency.lease. */
	private Duration lease;
	/** How long answers are replayed; unset: the database's idempotency.retention. */
	private Duration retention;
	/** The response headers a replay repeats. */
	private List<String> storeHeaders = new ArrayList<>(List.of("Content-Type", "Location"));
	/** The largest request body; a larger one is answered 413. */
	private DataSize maxBodySize = DataSize.ofMegabytes(1);
	/** How many times a claim without an answer is asked in all. */
	private int claimTries = 4;
	/** The first wait before a claim is asked again, doubled each time. */
	private Duration retryDelay = Duration.ofMillis(50);
	/**
	 * The claim, the handler's writes and complete in one transaction, for handlers whose effects are
	 * all in this database.
	 */
	private boolean oneTransaction;
	/**
	 * Claim, complete and release as named server-side statements, prepared once per connection: only on
	 * direct connections or through a pooler that keeps them (PgBouncer 1.21+ with max_prepared_statements).
	 */
	private boolean prepare;
	/** How long a duplicate waits for the request it repeats before 409; unset: none, 2s with one-transaction. */
	private Duration claimWait;

	/** @return whether to register the filter */
	public boolean isEnabled() {
		return enabled;
	}

	/** @param enabled whether to register the filter */
	public void setEnabled(boolean enabled) {
		this.enabled = enabled;
	}

	/** @return the methods that take a key */
	public List<String> getMethods() {
		return methods;
	}

	/** @param methods the methods that take a key */
	public void setMethods(List<String> methods) {
		this.methods = methods;
	}

	/** @return the URL patterns the filter covers */
	public List<String> getUrlPatterns() {
		return urlPatterns;
	}

	/** @param urlPatterns the URL patterns the filter covers */
	public void setUrlPatterns(List<String> urlPatterns) {
		this.urlPatterns = urlPatterns;
	}

	/** @return the filter's order */
	public int getFilterOrder() {
		return filterOrder;
	}

	/** @param filterOrder the filter's order */
	public void setFilterOrder(int filterOrder) {
		this.filterOrder = filterOrder;
	}

	/** @return whether a request without a key runs unguarded */
	public boolean isKeyOptional() {
		return keyOptional;
	}

	/** @param keyOptional whether a request without a key runs unguarded */
	public void setKeyOptional(boolean keyOptional) {
		this.keyOptional = keyOptional;
	}

	/** @return whether a failed claim runs the handler unguarded */
	public boolean isFailOpen() {
		return failOpen;
	}

	/** @param failOpen whether a failed claim runs the handler unguarded */
	public void setFailOpen(boolean failOpen) {
		this.failOpen = failOpen;
	}

	/** @return the lease, null for the database's setting */
	public Duration getLease() {
		return lease;
	}

	/** @param lease the lease */
	public void setLease(Duration lease) {
		this.lease = lease;
	}

	/** @return the retention, null for the database's setting */
	public Duration getRetention() {
		return retention;
	}

	/** @param retention the retention */
	public void setRetention(Duration retention) {
		this.retention = retention;
	}

	/** @return the response headers a replay repeats */
	public List<String> getStoreHeaders() {
		return storeHeaders;
	}

	/** @param storeHeaders the response headers a replay repeats */
	public void setStoreHeaders(List<String> storeHeaders) {
		this.storeHeaders = storeHeaders;
	}

	/** @return the largest request body */
	public DataSize getMaxBodySize() {
		return maxBodySize;
	}

	/** @param maxBodySize the largest request body */
	public void setMaxBodySize(DataSize maxBodySize) {
		this.maxBodySize = maxBodySize;
	}

	/** @return how many times a claim without an answer is asked in all */
	public int getClaimTries() {
		return claimTries;
	}

	/** @param claimTries how many times a claim without an answer is asked in all */
	public void setClaimTries(int claimTries) {
		this.claimTries = claimTries;
	}

	/** @return the first wait before a claim is asked again */
	public Duration getRetryDelay() {
		return retryDelay;
	}

	/** @param retryDelay the first wait before a claim is asked again */
	public void setRetryDelay(Duration retryDelay) {
		this.retryDelay = retryDelay;
	}

	/** @return whether the claim is in the handler's transaction */
	public boolean isOneTransaction() {
		return oneTransaction;
	}

	/** @param oneTransaction whether the claim is in the handler's transaction */
	public void setOneTransaction(boolean oneTransaction) {
		this.oneTransaction = oneTransaction;
	}

	/** @return whether the filter's statements are prepared once per connection */
	public boolean isPrepare() {
		return prepare;
	}

	/** @param prepare whether the filter's statements are prepared once per connection */
	public void setPrepare(boolean prepare) {
		this.prepare = prepare;
	}

	/** @return how long a duplicate waits, null for the default */
	public Duration getClaimWait() {
		return claimWait;
	}

	/** @param claimWait how long a duplicate waits */
	public void setClaimWait(Duration claimWait) {
		this.claimWait = claimWait;
	}
}
