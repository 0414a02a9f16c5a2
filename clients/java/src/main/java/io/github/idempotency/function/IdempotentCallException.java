package io.github.idempotency.function;

/**
 * Why an idempotent function did not run and has no result to give: {@link InProgress} (another run
 * holds the key past the wait), {@link Mismatch} (the key was used with other arguments) or
 * {@link Stored} (the first run failed with a final error, given back).
 */
public abstract class IdempotentCallException extends RuntimeException {
	private static final long serialVersionUID = 1L;
	private final String key;

	IdempotentCallException(String key, String message) {
		super(message);
		this.key = key;
	}

	/**
	 * The key.
	 *
	 * @return the key
	 */
	public String key() {
		return key;
	}

	/** Another run holds the key: try again after {@link #retryAfter()} seconds. */
	public static final class InProgress extends IdempotentCallException {
		private static final long serialVersionUID = 1L;
		private final int retryAfter;

		InProgress(String key, int retryAfter) {
			super(key, "idempotency key is in progress; retry in " + retryAfter + " s");
			this.retryAfter = retryAfter;
		}

		/**
		 * Whole seconds until the other run's lease ends, at least 1.
		 *
		 * @return the seconds
		 */
		public int retryAfter() {
			return retryAfter;
		}
	}

	/** The key was used with other arguments (as 422 is over HTTP). */
	public static final class Mismatch extends IdempotentCallException {
		private static final long serialVersionUID = 1L;

		Mismatch(String key) {
			super(key, "idempotency key was used with other arguments");
		}
	}

	/** The first run failed with a final error, stored: its class name and message. */
	public static final class Stored extends IdempotentCallException {
		private static final long serialVersionUID = 1L;
		private final String errorClass;

		Stored(String key, String errorClass, String message) {
			super(key, message);
			this.errorClass = errorClass;
		}

		/**
		 * The class name of the first run's error.
		 *
		 * @return the class name
		 */
		public String errorClass() {
			return errorClass;
		}
	}
}
