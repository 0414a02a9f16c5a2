package io.github.idempotency.servlet;

import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.concurrent.atomic.AtomicInteger;
import org.postgresql.PGStatement;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The examples' payment handler on plain JDBC: {"amount": N, "delay_ms": D, "fail": true, "throw": true}
 * inserts a charge through the filter's connection and answers 201 {"charge": id}.
 */
public class PaymentServlet extends HttpServlet {
	private static final long serialVersionUID = 1L;
	/** How many times the handler ran. */
	public final AtomicInteger runs = new AtomicInteger();
	private final String table;

	/** A handler that writes to table. */
	public PaymentServlet(String table) {
		this.table = table;
	}

	@Override
	protected void doPost(HttpServletRequest req, HttpServletResponse res) throws IOException {
		runs.incrementAndGet();
		String body = new String(req.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
		long delay = number(body, "delay_ms");
		if (delay > 0) {
			try {
				Thread.sleep(delay);
			} catch (InterruptedException e) {
				Thread.currentThread().interrupt();
			}
		}
		Connection db = IdempotencyFilter.connection(req);
		long id;
		try (PreparedStatement st = db.prepareStatement("INSERT INTO " + table + " (amount) VALUES (?) RETURNING id")) {
			// Never a named server-side statement, as an app behind a transaction pooler (PgBouncerIT)
			// sets on its own statements; the filter does so on its.
			st.unwrap(PGStatement.class).setPrepareThreshold(0);
			st.setLong(1, number(body, "amount"));
			try (ResultSet rs = st.executeQuery()) {
				rs.next();
				id = rs.getLong(1);
			}
		} catch (SQLException e) {
			throw new IOException(e);
		}
		if (body.contains("\"throw\":true")) {
			throw new IllegalStateException("the handler failed");
		}
		boolean fail = body.contains("\"fail\":true");
		res.setStatus(fail ? 500 : 201);
		res.setContentType("application/json");
		res.getWriter().write("{\"charge\":" + id + "}");
	}

	/** The number after "name": in body, 0 when absent. */
	static long number(String body, String name) {
		Matcher m = Pattern.compile("\"" + name + "\":(\\d+)").matcher(body);
		return m.find() ? Long.parseLong(m.group(1)) : 0;
	}
}
