package io.github.idempotency.servlet;

import io.github.idempotency.ClaimLostException;
import io.github.idempotency.ClaimRequest;
import io.github.idempotency.ClaimResult;
import io.github.idempotency.Fingerprint;
import io.github.idempotency.Flow;
import io.github.idempotency.Idempotency;
import io.github.idempotency.IdempotencyKey;
import io.github.idempotency.InvalidArgumentException;
import io.github.idempotency.Problem;
import jakarta.servlet.DispatcherType;
import jakarta.servlet.FilterChain;
import jakarta.servlet.ServletException;
import jakarta.servlet.ServletRequest;
import jakarta.servlet.ServletResponse;
import jakarta.servlet.http.HttpFilter;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.lang.System.Logger.Level;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.sql.Connection;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.stream.Collectors;
import javax.sql.DataSource;

/**
 * A Jakarta Servlet filter that makes the covered requests (POST and PATCH) safe to retry, as the
 * project's HTTP contract says (docs/http-contract.md): it claims the request's {@code Idempotency-Key},
 * answers retries from the stored response, and runs a new request's handler in a transaction that
 * commits with the stored response. The handler writes through that transaction: {@link #connection}
 * with plain JDBC, or whatever joins the transaction manager's transaction under Spring.
 */
public class IdempotencyFilter extends HttpFilter {
	private static final long serialVersionUID = 1L;
	private static final System.Logger LOG = System.getLogger(IdempotencyFilter.class.getName());

	/** The request attribute holding the handler's {@link Connection} (plain JDBC). */
	public static final String CONNECTION = IdempotencyFilter.class.getName() + ".connection";
	/** The request attribute holding the request's claim, a {@link ClaimResult.New}. */
	public static final String CLAIM = IdempotencyFilter.class.getName() + ".claim";

	private final transient DataSource dataSource;
	private final transient RequestTransactions transactions;
	private final transient IdempotencyOptions options;
	private final Set<String> methods;

	/**
	 * The filter on {@code dataSource}, with its defaults; the handler's transaction is plain JDBC.
	 *
	 * @param dataSource the pool
	 */
	public IdempotencyFilter(DataSource dataSource) {
		this(dataSource, new JdbcRequestTransactions(dataSource), new IdempotencyOptions());
	}

	/**
	 * The filter on {@code dataSource}, opening handlers' transactions with {@code transactions}.
	 *
	 * @param dataSource the pool the claims run on (autocommit, one connection at a time)
	 * @param transactions where the handler's transaction comes from
	 * @param options the options
	 */
	public IdempotencyFilter(DataSource dataSource, RequestTransactions transactions, IdempotencyOptions options) {
		this.dataSource = dataSource;
		this.transactions = transactions;
		this.options = options;
		this.methods = options.methods().stream().map(m -> m.toUpperCase(Locale.ROOT)).collect(Collectors.toSet());
	}

	/**
	 * The connection of the transaction the filter opened for this request's handler (plain JDBC): write
	 * through it, and do not commit, roll back or close it.
	 *
	 * @param request the request
	 * @return the connection; null on a request the filter does not cover
	 */
	public static Connection connection(ServletRequest request) {
		return (Connection) request.getAttribute(CONNECTION);
	}

	/**
	 * The request's claim: its attempt is above 1 when this run takes over from an attempt whose lease
	 * ended, and its recovery point holds what that attempt checkpointed.
	 *
	 * @param request the request
	 * @return the claim; null when the request runs unguarded
	 */
	public static ClaimResult.New claim(ServletRequest request) {
		return (ClaimResult.New) request.getAttribute(CLAIM);
	}

	/**
	 * The default scope, the same in every client of this project (docs/http-contract.md): the lowercase
	 * hex SHA-256 of {@code authorization:<Authorization>}, else of {@code x-api-key:<X-API-Key>}, else
	 * {@code ""}, over the header's bytes as sent. A credential itself is never stored. An application
	 * with its own authentication passes its principal or tenant through {@link IdempotencyOptions#scope}.
	 *
	 * @param request the request
	 * @return the scope
	 */
	public static String callerScope(HttpServletRequest request) {
		for (String name : List.of("Authorization", "X-API-Key")) {
			String value = request.getHeader(name);
			if (value != null) {
				return HexFormat.of().formatHex(sha256().digest(headerBytes(name.toLowerCase(Locale.ROOT) + ":" + value)));
			}
		}
		return "";
	}

	/**
	 * A header as the bytes sent: servlet containers decode header bytes as ISO-8859-1, one char a byte;
	 * a char above that (a container that decoded UTF-8) is encoded back as UTF-8.
	 */
	private static byte[] headerBytes(String value) {
		boolean latin1 = value.chars().allMatch(c -> c <= 0xFF);
		return value.getBytes(latin1 ? StandardCharsets.ISO_8859_1 : StandardCharsets.UTF_8);
	}

	@Override
	protected void doFilter(HttpServletRequest req, HttpServletResponse res, FilterChain chain)
			throws IOException, ServletException {
		if (req.getDispatcherType() != DispatcherType.REQUEST || !methods.contains(req.getMethod())) {
			chain.doFilter(req, res);
			return;
		}
		String key = null;
		if (options.key() == null) {
			try {
				key = IdempotencyKey.parse(Collections.list(req.getHeaders("Idempotency-Key")));
			} catch (IllegalArgumentException e) {
				problem(res, Problem.keyInvalid(e.getMessage()));
				return;
			}
		}
		byte[] body = readBody(req, res);
		if (body == null || !verified(req, res, body)) {
			return;
		}
		if (options.key() != null) {
			try {
				key = options.key().key(req, body);
			} catch (IllegalArgumentException e) {
				problem(res, Problem.keyInvalid(e.getMessage()));
				return;
			}
		}
		if (key == null && options.keyOptional()) {
			run(req, res, chain, body, null);
			return;
		}
		if (key == null) {
			problem(res, Problem.keyMissing());
			return;
		}
		String query = req.getQueryString();
		ClaimRequest claim = new ClaimRequest(options.scope().apply(req), key,
				Fingerprint.of(req.getMethod(), req.getRequestURI(), body.length == 0 ? null : body,
						query == null || query.isEmpty() ? null : query),
				options.lease(), options.retention(), options.claimWait(), Idempotency.newToken(), options.prepare());
		Claim result;
		try {
			result = claim(claim);
		} catch (InvalidArgumentException e) {
			problem(res, Problem.keyInvalid("the idempotency store refused this Idempotency-Key"));
			return;
		} catch (SQLException | RuntimeException e) {
			if (options.failOpen()) {
				LOG.log(Level.WARNING, "idempotency: running unguarded: " + e);
				run(req, res, chain, body, null);
			} else {
				unavailable(res, e);
			}
			return;
		}
		if (result.result() instanceof ClaimResult.New ticket) {
			run(req, res, chain, body, new Claimed(claim, ticket, result.tx()));
		} else {
			try {
				if (options.oneTransaction() && result.askedAgain()
						&& result.result() instanceof ClaimResult.InProgress busy) {
					// One transaction: most likely held by the lost claim's own transaction, which
					// never commits (a half-open connection): not a 409 for the request's own claim.
					LOG.log(Level.WARNING, "idempotency: the claim asked again after its answer was lost "
							+ "found the key still held");
					problem(res, Problem.claimHeld(busy.retryAfter()));
				} else {
					answer(res, result.result());
				}
				if (result.tx() != null) {
					res.flushBuffer(); // one transaction: the answer goes out, then the empty transaction ends
				}
			} finally {
				result.rollback();
			}
		}
	}

	/**
	 * A claim's answer; with one transaction, the transaction it ran in, open (the handler's when new),
	 * and whether it was asked again after a lost answer.
	 */
	private record Claim(ClaimResult result, RequestTransactions.RequestTransaction tx, boolean askedAgain) {
		/** Ends the transaction, if any. */
		void rollback() {
			if (tx != null) {
				tx.rollback();
			}
		}
	}

	/**
	 * A covered request's claim: what was asked (with the request's token), what won and, with one
	 * transaction, the transaction it is in, until the handler's run takes it.
	 */
	private static final class Claimed {
		final ClaimRequest request;
		ClaimResult.New ticket;
		RequestTransactions.RequestTransaction tx;
		/** What the last run stored (or tried to), for telling whether its lost COMMIT took effect. */
		IdempotencyOptions.Stored kept;

		Claimed(ClaimRequest request, ClaimResult.New ticket, RequestTransactions.RequestTransaction tx) {
			this.request = request;
			this.ticket = ticket;
			this.tx = tx;
		}
	}

	/**
	 * Claims, asking again with the same token when the answer was lost ({@link Flow#askingAgain}). With
	 * one transaction the claim runs in a new handler's transaction, returned open (a lost answer there
	 * means it rolled back: asked again in another).
	 */
	private Claim claim(ClaimRequest claim) throws SQLException {
		return Flow.askingAgain(options.claimTries(), options.retryDelay(), again -> {
			if (!options.oneTransaction()) {
				return new Claim(Idempotency.claim(dataSource, claim, options.tracer()), null, again);
			}
			RequestTransactions.RequestTransaction tx = transactions.begin();
			try {
				return new Claim(Idempotency.claim(tx.connection(), claim, options.tracer()), tx, again);
			} catch (SQLException | RuntimeException e) {
				tx.rollback();
				throw e;
			}
		});
	}

	/**
	 * Runs the handler in a transaction, holding the response until the transaction has ended. c is the
	 * request's claim, null when it runs unguarded. When the COMMIT's answer is lost, claiming again with
	 * the request's token tells what happened: replay (it committed: send the handler's response) or new
	 * (it rolled back: run the handler again).
	 */
	private void run(HttpServletRequest req, HttpServletResponse res, FilterChain chain, byte[] body, Claimed c)
			throws IOException, ServletException {
		for (int runs = 1; ; runs++) {
			BufferedResponse buffered = new BufferedResponse(res);
			if (!runOnce(req, buffered, chain, body, c)) {
				return;
			}
			if (c == null) {
				problem(res, Problem.unknown());
				return;
			}
			Claim asked;
			try {
				asked = claim(c.request);
			} catch (SQLException | RuntimeException e) {
				LOG.log(Level.ERROR, "idempotency: whether the request committed is unknown: " + e);
				problem(res, Problem.unknown());
				return;
			}
			ClaimResult again = asked.result();
			Flow.AfterLostCommit next = c.kept == null ? Flow.afterLostCommit(again, -1, null, runs)
					: Flow.afterLostCommit(again, c.kept.status(), c.kept.body(), runs);
			if (next == Flow.AfterLostCommit.COMMITTED) {
				asked.rollback();
				buffered.send(); // our COMMIT went through: the handler's answer, whole
				return;
			}
			res.reset();
			if (next == Flow.AfterLostCommit.OTHER) {
				// One transaction: a replay here is a duplicate's, which won after ours rolled back.
				asked.rollback();
				answer(res, again instanceof ClaimResult.InProgress ? null : again);
				return;
			}
			ClaimResult.New ticket = (ClaimResult.New) again;
			if (next == Flow.AfterLostCommit.GIVE_UP) {
				asked.rollback();
				release(ticket);
				problem(res, Problem.unavailable());
				return;
			}
			LOG.log(Level.WARNING, "idempotency: the COMMIT got no answer and rolled back; running the handler again");
			c.ticket = ticket;
			c.tx = asked.tx();
		}
	}

	/**
	 * Runs the handler once in a transaction of its own and ends that transaction. True, having sent
	 * nothing, when the answer to complete or to the COMMIT was lost.
	 */
	private boolean runOnce(HttpServletRequest req, BufferedResponse res, FilterChain chain, byte[] body, Claimed c)
			throws IOException, ServletException {
		ClaimResult.New ticket = c == null ? null : c.ticket;
		RequestTransactions.RequestTransaction tx = c == null ? null : c.tx;
		try {
			if (tx == null) {
				tx = transactions.begin();
			}
			if (c != null) {
				c.tx = null; // this run ends it
			}
		} catch (SQLException | RuntimeException e) {
			release(ticket);
			unavailable((HttpServletResponse) res.getResponse(), e);
			return false;
		}
		BodyRequest request = new BodyRequest(req, body);
		try {
			request.setAttribute(CONNECTION, tx.connection());
			request.setAttribute(CLAIM, ticket);
			chain.doFilter(request, res);
		} catch (SQLException e) {
			tx.rollback();
			release(ticket);
			throw new ServletException(e);
		} catch (IOException | ServletException | RuntimeException | Error e) {
			tx.rollback(); // a handler that fails: nothing commits, the key is released
			release(ticket);
			throw e;
		} finally {
			request.removeAttribute(CONNECTION);
			request.removeAttribute(CLAIM);
		}
		if (req.isAsyncStarted()) {
			// Guarded by async refusal in the Spring configuration; elsewhere the work is the handler's.
			tx.rollback();
			release(ticket);
			throw new ServletException("idempotency: an asynchronous handler cannot run behind the filter");
		}
		if (res.errorSent()) {
			tx.rollback(); // the container's error page: nothing to store, the retry runs again
			release(ticket);
			return false;
		}
		return settle(res, tx, c);
	}

	/**
	 * Ends the handler's transaction and sends its response: a 5xx rolls back and is handed to complete
	 * alone; otherwise complete and commit, or 409 (the claim was lost) or 503. True, sending nothing,
	 * when the answer to complete or to the COMMIT was lost.
	 */
	private boolean settle(BufferedResponse res, RequestTransactions.RequestTransaction tx, Claimed c)
			throws IOException {
		HttpServletResponse real = (HttpServletResponse) res.getResponse();
		ClaimResult.New ticket = c == null ? null : c.ticket;
		IdempotencyOptions.Stored kept;
		try {
			kept = c == null ? null : kept(res);
		} catch (RuntimeException e) {
			tx.rollback(); // nothing stored, nothing of the handler's kept: the retry runs again
			release(ticket);
			LOG.log(Level.ERROR, "idempotency: the redact option threw; nothing was stored", e);
			real.reset();
			problem(real, Problem.redactFailed());
			return false;
		}
		if (c != null) {
			c.kept = kept;
		}
		if (res.getStatus() >= 500) {
			tx.rollback();
			abandon(c, kept);
			res.send();
			return false;
		}
		try {
			if (ticket != null && tx.readyToComplete()) {
				// complete and COMMIT in one round trip; tx.commit() below then only ends the transaction
				ticket.completeAndCommit(tx.connection(), kept.status(), kept.body(), kept.headers());
			} else if (ticket != null) {
				ticket.complete(tx.connection(), kept.status(), kept.body(), kept.headers());
			}
		} catch (ClaimLostException e) {
			tx.rollback();
			real.reset();
			problem(real, Problem.claimLost());
			return false;
		} catch (SQLException | RuntimeException e) {
			tx.rollback();
			if (Flow.isLost(e)) {
				return true; // the COMMIT was never sent: rolled back; the claim tells
			}
			release(ticket);
			real.reset();
			unavailable(real, e);
			return false;
		}
		try {
			tx.commit();
		} catch (Exception e) {
			tx.rollback();
			if (Flow.isLost(e)) {
				return true;
			}
			release(ticket); // refused by the server (a deferred constraint): rolled back
			real.reset();
			unavailable(real, e);
			return false;
		}
		res.send();
		return false;
	}

	/**
	 * Hands a 5xx to complete on its own, which frees the key (or stores it with
	 * idempotency.store_server_errors on); release when that fails otherwise than by IK001. With one
	 * transaction the claim rolled back with the rest: the 5xx is kept only with that setting on.
	 */
	private void abandon(Claimed c, IdempotencyOptions.Stored kept) {
		if (c == null) {
			return;
		}
		ClaimResult.New ticket = c.ticket;
		int status = kept.status();
		byte[] body = kept.body();
		Map<String, List<String>> headers = kept.headers();
		try (Connection db = dataSource.getConnection()) {
			db.setAutoCommit(true);
			if (options.oneTransaction()) {
				Idempotency.keepServerError(db, c.request, status, body, headers, options.tracer());
				return;
			}
			ticket.complete(db, status, body, headers);
		} catch (ClaimLostException e) {
			// a retry owns the key: nothing of ours to free
		} catch (SQLException | RuntimeException e) {
			LOG.log(Level.WARNING, "idempotency: could not end the claim after a " + status + ": " + e);
			release(ticket);
		}
	}

	/**
	 * Frees the key of ticket (if any) so that a retry runs again; a failure only delays that retry.
	 * With one transaction there is nothing to free: the claim rolled back with the handler's writes.
	 */
	private void release(ClaimResult.New ticket) {
		if (!options.oneTransaction()) {
			Flow.release(dataSource, ticket);
		}
	}

	/**
	 * The headers of the response that a replay repeats: those of the options, and Content-Encoding, without
	 * which the stored body (compressed by a filter inside this one) could not be read.
	 */
	private Map<String, List<String>> storedHeaders(HttpServletResponse res) {
		Map<String, List<String>> stored = new LinkedHashMap<>();
		List<String> names = new ArrayList<>(options.storeHeaders());
		if (names.stream().noneMatch("Content-Encoding"::equalsIgnoreCase)) {
			names.add("Content-Encoding");
		}
		for (String name : names) {
			Collection<String> values = name.equalsIgnoreCase("Content-Type")
					? (res.getContentType() == null ? List.of() : List.of(res.getContentType()))
					: res.getHeaders(name);
			if (values != null && !values.isEmpty()) {
				stored.put(name, new ArrayList<>(values));
			}
		}
		return stored;
	}

	/** True when the options' verifier accepts the request; otherwise answers 401 (nothing is claimed). */
	private boolean verified(HttpServletRequest req, HttpServletResponse res, byte[] body) throws IOException {
		if (options.verify() == null) {
			return true;
		}
		try {
			options.verify().verify(req, body);
			return true;
		} catch (Exception e) {
			problem(res, new Problem(401, "webhook_unverified", "the request could not be verified: " + e.getMessage(), 0));
			return false;
		}
	}

	/** What is stored of the handler's response: as sent, or as the options' redactor makes it. */
	private IdempotencyOptions.Stored kept(BufferedResponse res) {
		HttpServletResponse real = (HttpServletResponse) res.getResponse();
		IdempotencyOptions.Stored sent = new IdempotencyOptions.Stored(res.getStatus(), storedHeaders(real), res.body());
		return options.redact() == null ? sent : options.redact().redact(sent.status(), sent.headers(), sent.body());
	}

	/** Reads the body (for the fingerprint); null when it answered instead (413, 400). */
	private byte[] readBody(HttpServletRequest req, HttpServletResponse res) throws IOException {
		byte[] body;
		try {
			body = req.getInputStream().readNBytes(options.maxBodyBytes() + 1);
		} catch (IOException e) {
			problem(res, new Problem(400, "request_body_unreadable", "the request body could not be read", 0));
			return null;
		}
		if (body.length > options.maxBodyBytes()) {
			problem(res, new Problem(413, "request_body_too_large",
					"the request body is over " + options.maxBodyBytes() + " bytes", 0));
			return null;
		}
		return body;
	}

	/** Answers a claim that did not win: replay, in progress or mismatch; null: the claim was lost. */
	private static void answer(HttpServletResponse res, ClaimResult result) throws IOException {
		if (result instanceof ClaimResult.Replay replay) {
			replay.headers().forEach((name, values) -> values.forEach(v -> res.addHeader(name, v)));
			res.setHeader("Idempotent-Replayed", "true");
			res.setStatus(replay.statusCode());
			res.setContentLength(replay.body().length);
			res.getOutputStream().write(replay.body());
		} else if (result instanceof ClaimResult.InProgress busy) {
			problem(res, Problem.inProgress(busy.retryAfter()));
		} else if (result instanceof ClaimResult.Mismatch) {
			problem(res, Problem.mismatch());
		} else {
			problem(res, Problem.claimLost());
		}
	}

	/** Fails closed: without the store, a retry could run twice. Nothing of the request committed. */
	private static void unavailable(HttpServletResponse res, Exception e) throws IOException {
		LOG.log(Level.ERROR, "idempotency: " + e);
		problem(res, Problem.unavailable());
	}

	/**
	 * Answers with a problem+json body.
	 *
	 * @param res the response, uncommitted
	 * @param p the problem
	 * @throws IOException when the client went away
	 */
	static void problem(HttpServletResponse res, Problem p) throws IOException {
		byte[] json = p.toJson();
		res.setStatus(p.status());
		res.setContentType(Problem.CONTENT_TYPE);
		if (p.retryAfter() > 0) {
			res.setHeader("Retry-After", Integer.toString(p.retryAfter()));
		}
		res.setContentLength(json.length);
		res.getOutputStream().write(json);
	}

	/** A SHA-256 digest. */
	private static MessageDigest sha256() {
		try {
			return MessageDigest.getInstance("SHA-256");
		} catch (java.security.NoSuchAlgorithmException e) {
			throw new IllegalStateException(e);
		}
	}
}
