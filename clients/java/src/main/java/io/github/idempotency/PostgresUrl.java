package io.github.idempotency;

import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;

/**
 * A libpq connection URI, as {@code DATABASE_URL} usually holds one, as a pgjdbc URL.
 */
public final class PostgresUrl {
	private PostgresUrl() {
	}

	/**
	 * {@code postgresql://user:password@host:port/db?param=value} (or {@code postgres://}) as
	 * {@code jdbc:postgresql://host:port/db?user=...&password=...&param=value}. The parameters pass
	 * through (pgjdbc knows {@code sslmode}, {@code options}, {@code application_name}...). A host given
	 * as a Unix-socket directory ({@code ?host=/run/postgresql}) connects through that directory's
	 * socket with junixsocket's socket factory, which must then be on the class path
	 * ({@code com.kohlschutter.junixsocket:junixsocket-core}). A {@code jdbc:} URL is returned as it is.
	 *
	 * @param url the URI
	 * @return the JDBC URL
	 * @throws IllegalArgumentException when it is not a postgresql URI
	 */
	public static String toJdbc(String url) {
		if (url.startsWith("jdbc:")) {
			return url;
		}
		int schemeEnd = url.indexOf("://");
		String scheme = schemeEnd < 0 ? "" : url.substring(0, schemeEnd);
		if (!scheme.equals("postgresql") && !scheme.equals("postgres")) {
			throw new IllegalArgumentException("not a postgresql:// URI");
		}
		String rest = url.substring(schemeEnd + 3);
		int queryAt = rest.indexOf('?');
		String query = queryAt < 0 ? null : rest.substring(queryAt + 1);
		rest = queryAt < 0 ? rest : rest.substring(0, queryAt);
		int pathAt = rest.indexOf('/');
		String authority = pathAt < 0 ? rest : rest.substring(0, pathAt);
		String path = pathAt < 0 ? "/" : rest.substring(pathAt);
		int at = authority.lastIndexOf('@');
		String userInfo = at < 0 ? null : authority.substring(0, at);
		String hostPort = authority.substring(at + 1);
		int portAt = hostPort.lastIndexOf(':');
		if (portAt < hostPort.lastIndexOf(']')) {
			portAt = -1; // an IPv6 address without a port
		}
		String host = portAt < 0 ? hostPort : hostPort.substring(0, portAt);
		String port = portAt < 0 || portAt == hostPort.length() - 1 ? "5432" : hostPort.substring(portAt + 1);
		List<String> params = new ArrayList<>();
		String socketDir = null;
		if (query != null) {
			for (String param : query.split("&")) {
				String decoded = URLDecoder.decode(param, StandardCharsets.UTF_8);
				if (decoded.startsWith("host=/")) {
					socketDir = decoded.substring(5);
				} else if (decoded.startsWith("port=")) {
					port = decoded.substring(5);
				} else if (!param.isEmpty()) {
					params.add(param);
				}
			}
		}
		if (userInfo != null) {
			int colon = userInfo.indexOf(':');
			params.add(0, "user=" + (colon < 0 ? userInfo : userInfo.substring(0, colon)));
			if (colon >= 0) {
				params.add(1, "password=" + userInfo.substring(colon + 1));
			}
		}
		if (socketDir != null) {
			params.add("socketFactory=org.newsclub.net.unix.AFUNIXSocketFactory$FactoryArg");
			params.add("socketFactoryArg=" + socketDir + "/.s.PGSQL." + port);
			host = "localhost";
		} else if (host.isEmpty()) {
			host = "localhost";
		}
		return "jdbc:postgresql://" + host + ":" + port + path + (params.isEmpty() ? "" : "?" + String.join("&", params));
	}
}
