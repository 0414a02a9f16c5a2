package io.github.idempotency.bench;

import java.io.FilterInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.net.InetAddress;
import java.net.Socket;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;
import javax.net.SocketFactory;

/**
 * A pgjdbc socket factory ({@code socketFactory=...&socketFactoryArg=NAME&sslmode=disable}) that counts
 * the ReadyForQuery messages its connections receive, one per round trip, following the protocol's
 * framing (a type byte and a length); the count is kept per NAME.
 */
public final class CountingSocketFactory extends SocketFactory {
	/** Round trips so far, per factory argument. */
	public static final Map<String, AtomicLong> ROUND_TRIPS = new ConcurrentHashMap<>();
	private final AtomicLong count;

	/** A factory counting under name. */
	public CountingSocketFactory(String name) {
		count = ROUND_TRIPS.computeIfAbsent(name, n -> new AtomicLong());
	}

	@Override
	public Socket createSocket() {
		return new Socket() {
			private InputStream in;

			@Override
			public synchronized InputStream getInputStream() throws IOException {
				if (in == null) {
					in = new Counting(super.getInputStream(), count);
				}
				return in;
			}
		};
	}

	@Override
	public Socket createSocket(String host, int port) throws IOException {
		throw new IOException("unconnected sockets only");
	}

	@Override
	public Socket createSocket(String host, int port, InetAddress localHost, int localPort) throws IOException {
		throw new IOException("unconnected sockets only");
	}

	@Override
	public Socket createSocket(InetAddress host, int port) throws IOException {
		throw new IOException("unconnected sockets only");
	}

	@Override
	public Socket createSocket(InetAddress address, int port, InetAddress localAddress, int localPort)
			throws IOException {
		throw new IOException("unconnected sockets only");
	}

	/** Follows the message framing of what the server sends, counting 'Z'. */
	private static final class Counting extends FilterInputStream {
		private final AtomicLong count;
		private int header = 0; // bytes of the current header read (type + 4 length bytes)
		private int length;
		private long remaining; // payload bytes left in the current message

		Counting(InputStream in, AtomicLong count) {
			super(in);
			this.count = count;
		}

		@Override
		public int read() throws IOException {
			int b = super.read();
			if (b >= 0) {
				see((byte) b);
			}
			return b;
		}

		@Override
		public int read(byte[] buf, int off, int len) throws IOException {
			int n = super.read(buf, off, len);
			for (int i = 0; i < n; i++) {
				see(buf[off + i]);
			}
			return n;
		}

		private void see(byte b) {
			if (remaining > 0) {
				remaining--;
				return;
			}
			if (header == 0) {
				if (b == 'Z') {
					count.incrementAndGet();
				}
				header = 1;
				length = 0;
				return;
			}
			length = (length << 8) | (b & 0xff);
			if (++header == 5) {
				header = 0;
				remaining = length - 4;
			}
		}
	}
}
