package io.github.idempotency.servlet;

import jakarta.servlet.ServletOutputStream;
import jakarta.servlet.WriteListener;
import jakarta.servlet.http.HttpServletResponse;
import jakarta.servlet.http.HttpServletResponseWrapper;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.nio.charset.Charset;

/**
 * Holds the handler's body until its transaction has ended: the filter may still have to answer
 * otherwise (409, 503) or run the handler again. The status and headers go to the real response, which
 * stays uncommitted until {@link #send}. A {@code sendError} passes through (the container renders its
 * error page), and marks the response as one the filter cannot store.
 */
final class BufferedResponse extends HttpServletResponseWrapper {
	private final ByteArrayOutputStream body = new ByteArrayOutputStream();
	private ServletOutputStream stream;
	private PrintWriter writer;
	private boolean errorSent;

	/** A buffer in front of response. */
	BufferedResponse(HttpServletResponse response) {
		super(response);
	}

	@Override
	public ServletOutputStream getOutputStream() {
		if (writer != null) {
			throw new IllegalStateException("getWriter() has been called on this response");
		}
		if (stream == null) {
			stream = new ServletOutputStream() {
				@Override
				public void write(int b) {
					body.write(b);
				}

				@Override
				public void write(byte[] b, int off, int len) {
					body.write(b, off, len);
				}

				@Override
				public boolean isReady() {
					return true;
				}

				@Override
				public void setWriteListener(WriteListener listener) {
					throw new IllegalStateException("the idempotency filter buffers the response: write it blocking");
				}
			};
		}
		return stream;
	}

	@Override
	public PrintWriter getWriter() {
		if (stream != null) {
			throw new IllegalStateException("getOutputStream() has been called on this response");
		}
		if (writer == null) {
			writer = new PrintWriter(new OutputStreamWriter(body, Charset.forName(getCharacterEncoding())));
		}
		return writer;
	}

	@Override
	public void flushBuffer() {
		if (writer != null) {
			writer.flush();
		}
	}

	@Override
	public void setContentLength(int len) {
		// set by send() from what was buffered
	}

	@Override
	public void setContentLengthLong(long len) {
		// set by send() from what was buffered
	}

	@Override
	public void resetBuffer() {
		flushBuffer();
		body.reset();
	}

	@Override
	public void reset() {
		super.reset();
		resetBuffer();
	}

	@Override
	public boolean isCommitted() {
		return errorSent || super.isCommitted();
	}

	@Override
	public void sendError(int sc, String msg) throws IOException {
		errorSent = true;
		super.sendError(sc, msg);
	}

	@Override
	public void sendError(int sc) throws IOException {
		errorSent = true;
		super.sendError(sc);
	}

	@Override
	public void sendRedirect(String location) {
		setStatus(SC_FOUND);
		setHeader("Location", location);
	}

	/** Whether the handler sent an error page (sendError): its body is the container's, not held here. */
	boolean errorSent() {
		return errorSent;
	}

	/** The body the handler wrote. */
	byte[] body() {
		flushBuffer();
		return body.toByteArray();
	}

	/** Sends the held body on the real response (status and headers are there already). */
	void send() throws IOException {
		byte[] bytes = body();
		HttpServletResponse real = (HttpServletResponse) getResponse();
		real.setContentLength(bytes.length);
		real.getOutputStream().write(bytes);
		real.flushBuffer();
	}
}
