package io.github.idempotency;

/** What a claim answers: whether to run the request, and what to answer otherwise. */
public enum Outcome {
	/** No live record, or a takeover of an ended lease: run the request, then complete or release. */
	NEW,
	/** A completed record with the same fingerprint: send the stored response again. */
	REPLAY,
	/** A live owner holds the lease: answer 409 with Retry-After. */
	IN_PROGRESS,
	/** The key belongs to another request (its fingerprint differs): answer 422. */
	MISMATCH;

	/**
	 * The outcome as claim's text names it.
	 *
	 * @return new, replay, in_progress or mismatch
	 */
	public String text() {
		return name().toLowerCase(java.util.Locale.ROOT);
	}

	/** The outcome that claim's text names. */
	static Outcome of(String text) {
		switch (text) {
			case "new": return NEW;
			case "replay": return REPLAY;
			case "in_progress": return IN_PROGRESS;
			case "mismatch": return MISMATCH;
			default: throw new IllegalArgumentException("unknown claim outcome: " + text);
		}
	}
}
