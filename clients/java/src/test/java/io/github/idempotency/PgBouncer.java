package io.github.idempotency;

import java.io.IOException;
import java.net.ServerSocket;
import java.net.URI;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.attribute.PosixFilePermissions;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * Debian's pgbouncer (/usr/sbin/pgbouncer, or $PGBOUNCER) on 127.0.0.1 in front of DATABASE_URL's
 * server, in transaction pooling with two server connections per pool, and nothing else changed but
 * {@code ignore_startup_parameters = extra_float_digits} (pgjdbc sends it at startup; every pgjdbc
 * deployment behind pgbouncer sets it).
 */
public final class PgBouncer implements AutoCloseable {
	/** The binary. */
	public static final Path BINARY = Path.of(System.getenv().getOrDefault("PGBOUNCER", "/usr/sbin/pgbouncer"));

	private final Path dir;
	private final Process process;
	private final String url;

	/** Starts it and waits until it accepts a connection (at most 30 s). */
	public PgBouncer() throws IOException, InterruptedException {
		URI target = URI.create(System.getenv("DATABASE_URL"));
		String db = target.getPath().substring(1);
		String user = target.getUserInfo() == null ? "postgres" : target.getUserInfo().split(":")[0];
		String host = target.getHost();
		for (String param : target.getQuery() == null ? new String[0] : target.getQuery().split("&")) {
			if (param.startsWith("host=")) {
				host = param.substring(5); // a Unix-socket directory
			}
		}
		int port = freePort();
		dir = Files.createTempDirectory("pg-idempotency-pgbouncer-");
		Files.setPosixFilePermissions(dir, PosixFilePermissions.fromString("rwxrwxrwx"));
		Files.writeString(dir.resolve("users.txt"), "\"" + user + "\" \"\"\n");
		Files.writeString(dir.resolve("pgbouncer.ini"), "[databases]\n"
				+ db + " = host=" + host + " port=" + (target.getPort() < 0 ? 5432 : target.getPort()) + " dbname=" + db + "\n"
				+ "[pgbouncer]\n"
				+ "listen_addr = 127.0.0.1\nlisten_port = " + port + "\nunix_socket_dir =\n"
				+ "auth_type = trust\nauth_file = " + dir.resolve("users.txt") + "\n"
				+ "pool_mode = transaction\ndefault_pool_size = 2\n"
				+ "ignore_startup_parameters = extra_float_digits\n"
				+ "logfile = " + dir.resolve("pgbouncer.log") + "\n");
		List<String> command = new ArrayList<>(List.of(BINARY.toString(), dir.resolve("pgbouncer.ini").toString()));
		if ("root".equals(System.getProperty("user.name"))) {
			command.addAll(0, List.of("runuser", "-u", "postgres", "--")); // it refuses to run as root
		}
		process = new ProcessBuilder(command).redirectErrorStream(true)
				.redirectOutput(dir.resolve("stdout.txt").toFile()).start();
		url = "jdbc:postgresql://127.0.0.1:" + port + "/" + db + "?user=" + user;
		long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
		while (true) {
			try (Connection c = DriverManager.getConnection(url)) {
				c.isValid(5);
				return;
			} catch (SQLException e) {
				if (!process.isAlive() || System.nanoTime() > deadline) {
					close();
					throw new IOException("pgbouncer did not start: " + log(), e);
				}
				Thread.sleep(100);
			}
		}
	}

	/** Whether the binary is there (the tests skip, saying so, without it). */
	public static boolean available() {
		return Files.isExecutable(BINARY);
	}

	/** A pgjdbc URL through it, with pgjdbc's defaults (prepareThreshold 5). */
	public String url() {
		return url;
	}

	/** What it logged. */
	public String log() throws IOException {
		Path log = dir.resolve("pgbouncer.log");
		return Files.exists(log) ? Files.readString(log) : Files.readString(dir.resolve("stdout.txt"));
	}

	@Override
	public void close() throws IOException {
		// runuser passes SIGTERM on to pgbouncer, which then exits.
		process.destroy();
		try {
			if (!process.waitFor(10, TimeUnit.SECONDS)) {
				process.descendants().forEach(ProcessHandle::destroyForcibly);
				process.destroyForcibly().waitFor();
			}
		} catch (InterruptedException e) {
			Thread.currentThread().interrupt();
		}
		try (var files = Files.walk(dir)) {
			files.sorted(java.util.Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
		}
	}

	/** A free TCP port on 127.0.0.1. */
	private static int freePort() throws IOException {
		try (ServerSocket s = new ServerSocket(0, 1, java.net.InetAddress.getByName("127.0.0.1"))) {
			return s.getLocalPort();
		}
	}
}
