package io.github.idempotency.spring;

import io.github.idempotency.servlet.IdempotencyFilter;
import io.github.idempotency.servlet.IdempotencyOptions;
import io.opentelemetry.api.OpenTelemetry;
import jakarta.servlet.DispatcherType;
import java.util.concurrent.Callable;
import javax.sql.DataSource;
import org.springframework.beans.factory.ObjectProvider;
import org.springframework.boot.autoconfigure.AutoConfiguration;
import org.springframework.boot.autoconfigure.condition.ConditionalOnClass;
import org.springframework.boot.autoconfigure.condition.ConditionalOnMissingBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnProperty;
import org.springframework.boot.autoconfigure.condition.ConditionalOnSingleCandidate;
import org.springframework.boot.autoconfigure.condition.ConditionalOnWebApplication;
import org.springframework.boot.context.properties.EnableConfigurationProperties;
import org.springframework.boot.web.servlet.FilterRegistrationBean;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;
import org.springframework.transaction.PlatformTransactionManager;
import org.springframework.web.context.request.NativeWebRequest;
import org.springframework.web.context.request.RequestAttributes;
import org.springframework.web.context.request.async.CallableProcessingInterceptor;
import org.springframework.web.context.request.async.DeferredResult;
import org.springframework.web.context.request.async.DeferredResultProcessingInterceptor;
import org.springframework.web.servlet.config.annotation.AsyncSupportConfigurer;
import org.springframework.web.servlet.config.annotation.WebMvcConfigurer;

/**
 * Registers {@link IdempotencyFilter} in a Spring Boot servlet application that has a DataSource and a
 * transaction manager: the filter claims on the DataSource and runs each new request's handler in a
 * transaction of the transaction manager, which {@code complete} joins. Configured with the
 * {@code idempotency.*} properties ({@link IdempotencyProperties}); {@code idempotency.enabled=false}
 * turns it off, and a bean of type IdempotencyFilter of your own replaces it.
 */
@AutoConfiguration(afterName = {
		"org.springframework.boot.jdbc.autoconfigure.DataSourceAutoConfiguration",
		"org.springframework.boot.jdbc.autoconfigure.DataSourceTransactionManagerAutoConfiguration",
		"org.springframework.boot.hibernate.autoconfigure.HibernateJpaAutoConfiguration",
		"org.springframework.boot.transaction.autoconfigure.TransactionAutoConfiguration"})
@ConditionalOnWebApplication(type = ConditionalOnWebApplication.Type.SERVLET)
@ConditionalOnClass({IdempotencyFilter.class, PlatformTransactionManager.class, FilterRegistrationBean.class})
@ConditionalOnSingleCandidate(DataSource.class)
@ConditionalOnProperty(prefix = "idempotency", name = "enabled", matchIfMissing = true)
@EnableConfigurationProperties(IdempotencyProperties.class)
public class IdempotencyAutoConfiguration {

	/**
	 * The filter, on the DataSource and the transaction manager.
	 *
	 * @param dataSource the application's DataSource
	 * @param transactionManager its transaction manager
	 * @param properties the idempotency.* properties
	 * @param openTelemetry the application's OpenTelemetry, if it has one (else the global one)
	 * @return the filter
	 */
	@Bean
	@ConditionalOnMissingBean
	@ConditionalOnSingleCandidate(PlatformTransactionManager.class)
	public IdempotencyFilter idempotencyFilter(DataSource dataSource, PlatformTransactionManager transactionManager,
			IdempotencyProperties properties, ObjectProvider<OpenTelemetry> openTelemetry) {
		IdempotencyOptions options = new IdempotencyOptions()
				.methods(properties.getMethods())
				.keyOptional(properties.isKeyOptional())
				.failOpen(properties.isFailOpen())
				.lease(properties.getLease())
				.retention(properties.getRetention())
				.storeHeaders(properties.getStoreHeaders())
				.maxBodyBytes(Math.toIntExact(properties.getMaxBodySize().toBytes()))
				.claimTries(properties.getClaimTries())
				.retryDelay(properties.getRetryDelay())
				.oneTransaction(properties.isOneTransaction())
				.prepare(properties.isPrepare())
				.claimWait(properties.getClaimWait());
		openTelemetry.ifUnique(options::openTelemetry);
		return new IdempotencyFilter(dataSource, new SpringRequestTransactions(transactionManager, dataSource),
				options);
	}

	/**
	 * The filter's registration: REQUEST dispatches of the URL patterns, in the order of the properties.
	 *
	 * @param filter the filter
	 * @param properties the idempotency.* properties
	 * @return the registration
	 */
	@Bean
	@ConditionalOnMissingBean(name = "idempotencyFilterRegistration")
	public FilterRegistrationBean<IdempotencyFilter> idempotencyFilterRegistration(IdempotencyFilter filter,
			IdempotencyProperties properties) {
		FilterRegistrationBean<IdempotencyFilter> registration = new FilterRegistrationBean<>(filter);
		registration.setDispatcherTypes(DispatcherType.REQUEST);
		registration.setUrlPatterns(properties.getUrlPatterns());
		registration.setOrder(properties.getFilterOrder());
		return registration;
	}

	/** Refuses asynchronous handlers behind the filter (Spring MVC present). */
	@Configuration(proxyBeanMethods = false)
	@ConditionalOnClass(WebMvcConfigurer.class)
	static class AsyncRefusal implements WebMvcConfigurer {
		@Override
		public void configureAsyncSupport(AsyncSupportConfigurer configurer) {
			configurer.registerCallableInterceptors(new CallableProcessingInterceptor() {
				@Override
				public <T> void beforeConcurrentHandling(NativeWebRequest request, Callable<T> task) {
					refuse(request);
				}
			});
			configurer.registerDeferredResultInterceptors(new DeferredResultProcessingInterceptor() {
				@Override
				public <T> void beforeConcurrentHandling(NativeWebRequest request, DeferredResult<T> result) {
					refuse(request);
				}
			});
		}

		/**
		 * Refuses to start asynchronous processing of a request the filter runs in a transaction: work
		 * on another thread would not be in it, could outlive a timeout, and could not be undone. The
		 * handler fails (its writes roll back, the key is released) and nothing asynchronous starts.
		 */
		private static void refuse(NativeWebRequest request) {
			if (request.getAttribute(IdempotencyFilter.CONNECTION, RequestAttributes.SCOPE_REQUEST) != null) {
				throw new IllegalStateException("idempotency: a handler behind the idempotency filter must answer "
						+ "synchronously (not Callable, DeferredResult or WebAsyncTask)");
			}
		}
	}
}
