package io.github.idempotency.servlet;

import jakarta.servlet.Filter;
import jakarta.servlet.FilterChain;
import jakarta.servlet.ServletException;
import jakarta.servlet.ServletRequest;
import jakarta.servlet.ServletResponse;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.Arrays;
import java.util.HexFormat;
import javax.sql.DataSource;

/**
 * The hand-written recipe, with no idempotency library: what a careful team writes with JDBC and a
 * servlet filter before it reaches for one, the yardstick of the bench's Overhead. It borrows only the
 * filter's servlet plumbing: BodyRequest to read the body again, BufferedResponse to hold the answer.
 * In one transaction, INSERT ... ON CONFLICT DO NOTHING claims (scope, key) in a table of its own; when
 * it inserted, the handler's work (through the request's connection, as the filter gives it) and the
 * UPDATE that stores the response; when it did not (the key committed before, or a concurrent duplicate
 * waited on the unique index until it did), the SELECT of the stored response: replayed when the
 * request hash is the same, else 422. Scoped per caller (a hash of the credential). An error or a 5xx
 * rolls the claim back with the work, so that a retry runs again; so does a crash.
 */
public final class RecipeFilter implements Filter {
	/** The recipe's table. */
	public static final String TABLE = "CREATE TABLE IF NOT EXISTS recipe_keys (scope text NOT NULL, key text NOT NULL,"
			+ " request_hash bytea NOT NULL, status text NOT NULL DEFAULT 'started', response_code int,"
			+ " response_body bytea, created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))";
	private static final String CLAIM = "INSERT INTO recipe_keys (scope, key, request_hash) VALUES (?, ?, ?)"
			+ " ON CONFLICT DO NOTHING";
	private static final String STORED = "SELECT request_hash, status, response_code, response_body"
			+ " FROM recipe_keys WHERE scope = ? AND key = ?";
	private static final String STORE = "UPDATE recipe_keys SET status = 'completed', response_code = ?,"
			+ " response_body = ? WHERE scope = ? AND key = ?";
	private final DataSource pool;

	public RecipeFilter(DataSource pool) {
		this.pool = pool;
	}

	@Override
	public void doFilter(ServletRequest request, ServletResponse response, FilterChain chain)
			throws IOException, ServletException {
		HttpServletRequest req = (HttpServletRequest) request;
		HttpServletResponse res = (HttpServletResponse) response;
		String key = req.getHeader("Idempotency-Key");
		if (key == null || key.isEmpty() || key.length() > 255) {
			res.sendError(400, "Idempotency-Key required");
			return;
		}
		byte[] body = req.getInputStream().readAllBytes();
		String credential = req.getHeader("Authorization");
		String scope = HexFormat.of().formatHex(sha256(
				(credential == null ? "" : credential).getBytes(StandardCharsets.ISO_8859_1), new byte[0]));
		byte[] requestHash = sha256((req.getMethod() + " " + req.getRequestURI() + "\n")
				.getBytes(StandardCharsets.UTF_8), body);
		try (Connection db = pool.getConnection()) {
			db.setAutoCommit(false);
			try {
				if (claimed(db, scope, key, requestHash)) {
					run(db, scope, key, new BodyRequest(req, body), res, chain);
				} else {
					replay(db, scope, key, requestHash, res);
				}
			} catch (SQLException | IOException | ServletException | RuntimeException e) {
				db.rollback();
				throw e;
			}
		} catch (SQLException e) {
			throw new ServletException(e);
		}
	}

	/** Whether this request inserted the key (else it was there). */
	private static boolean claimed(Connection db, String scope, String key, byte[] requestHash) throws SQLException {
		try (PreparedStatement st = db.prepareStatement(CLAIM)) {
			st.setString(1, scope);
			st.setString(2, key);
			st.setBytes(3, requestHash);
			return st.executeUpdate() == 1;
		}
	}

	/** Runs the handler; stores its answer and commits (a 5xx rolls back), then sends the answer. */
	private static void run(Connection db, String scope, String key, HttpServletRequest req, HttpServletResponse res,
			FilterChain chain) throws SQLException, IOException, ServletException {
		req.setAttribute(IdempotencyFilter.CONNECTION, db);
		BufferedResponse buffered = new BufferedResponse(res);
		chain.doFilter(req, buffered);
		byte[] answer = buffered.body();
		if (buffered.getStatus() >= 500) {
			db.rollback();
		} else {
			try (PreparedStatement st = db.prepareStatement(STORE)) {
				st.setInt(1, buffered.getStatus());
				st.setBytes(2, answer);
				st.setString(3, scope);
				st.setString(4, key);
				st.executeUpdate();
			}
			db.commit();
		}
		buffered.send();
	}

	/** Answers a key that was there: its stored response, 422 for another request, 409 in progress. */
	private static void replay(Connection db, String scope, String key, byte[] requestHash, HttpServletResponse res)
			throws SQLException, IOException {
		try (PreparedStatement st = db.prepareStatement(STORED)) {
			st.setString(1, scope);
			st.setString(2, key);
			byte[] storedHash;
			boolean completed;
			int status;
			byte[] stored;
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				storedHash = rs.getBytes(1);
				completed = "completed".equals(rs.getString(2));
				status = rs.getInt(3);
				stored = rs.getBytes(4);
			}
			db.commit();
			if (!Arrays.equals(storedHash, requestHash)) {
				res.sendError(422, "key reused");
			} else if (!completed) {
				res.sendError(409, "in progress");
			} else {
				res.setStatus(status);
				res.setContentType("application/json");
				res.setHeader("Idempotent-Replayed", "true");
				res.getOutputStream().write(stored);
			}
		}
	}

	/** The SHA-256 of a then b. */
	private static byte[] sha256(byte[] a, byte[] b) {
		try {
			MessageDigest digest = MessageDigest.getInstance("SHA-256");
			digest.update(a);
			return digest.digest(b);
		} catch (NoSuchAlgorithmException e) {
			throw new IllegalStateException(e);
		}
	}
}
