package io.github.idempotency.servlet;

import jakarta.servlet.Filter;
import jakarta.servlet.Servlet;
import java.nio.file.Files;
import org.apache.catalina.Context;
import org.apache.catalina.LifecycleException;
import org.apache.catalina.connector.Connector;
import org.apache.catalina.startup.Tomcat;
import org.apache.tomcat.util.descriptor.web.FilterDef;
import org.apache.tomcat.util.descriptor.web.FilterMap;

/** An embedded Tomcat on 127.0.0.1 serving one servlet behind the filters given, in order. */
public final class TomcatServer implements AutoCloseable {
	private final Tomcat tomcat = new Tomcat();
	private final Connector connector = new Connector();

	/** Starts servlet at /* behind filters. */
	public TomcatServer(Servlet servlet, Filter... filters) throws Exception {
		tomcat.setBaseDir(Files.createTempDirectory("tomcat").toString());
		connector.setPort(0);
		connector.setProperty("address", "127.0.0.1");
		tomcat.setConnector(connector);
		Context ctx = tomcat.addContext("", null);
		Tomcat.addServlet(ctx, "app", servlet);
		ctx.addServletMappingDecoded("/*", "app");
		for (int i = 0; i < filters.length; i++) {
			FilterDef def = new FilterDef();
			def.setFilterName("f" + i);
			def.setFilter(filters[i]);
			ctx.addFilterDef(def);
			FilterMap map = new FilterMap();
			map.setFilterName("f" + i);
			map.addURLPattern("/*");
			ctx.addFilterMap(map);
		}
		tomcat.start();
	}

	/** The port it listens on. */
	public int port() {
		return connector.getLocalPort();
	}

	@Override
	public void close() throws LifecycleException {
		tomcat.stop();
		tomcat.destroy();
	}
}
