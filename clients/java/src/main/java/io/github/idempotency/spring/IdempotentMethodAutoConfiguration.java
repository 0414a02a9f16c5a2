package io.github.idempotency.spring;

import javax.sql.DataSource;
import org.springframework.aop.Advisor;
import org.springframework.aop.support.DefaultPointcutAdvisor;
import org.springframework.aop.support.annotation.AnnotationMatchingPointcut;
import org.springframework.beans.factory.ObjectProvider;
import org.springframework.beans.factory.config.BeanDefinition;
import org.springframework.boot.autoconfigure.AutoConfiguration;
import org.springframework.boot.autoconfigure.condition.ConditionalOnClass;
import org.springframework.boot.autoconfigure.condition.ConditionalOnMissingBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnProperty;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Role;
import org.springframework.transaction.PlatformTransactionManager;

/**
 * Makes the beans' methods annotated {@link Idempotent} run once per key, with Spring's own AOP (an
 * advisor, as {@code @Transactional} has). {@code idempotency.enabled=false} turns it off.
 */
@AutoConfiguration(afterName = {
		"org.springframework.boot.jdbc.autoconfigure.DataSourceAutoConfiguration",
		"org.springframework.boot.jdbc.autoconfigure.DataSourceTransactionManagerAutoConfiguration",
		"org.springframework.boot.hibernate.autoconfigure.HibernateJpaAutoConfiguration",
		"org.springframework.boot.transaction.autoconfigure.TransactionAutoConfiguration"})
@ConditionalOnClass(name = {"org.springframework.transaction.PlatformTransactionManager",
		"org.aopalliance.intercept.MethodInterceptor", "tools.jackson.databind.json.JsonMapper"})
@ConditionalOnProperty(prefix = "idempotency", name = "enabled", matchIfMissing = true)
public class IdempotentMethodAutoConfiguration {

	/**
	 * The advisor of the methods annotated {@link Idempotent}; the DataSource and the transaction
	 * manager are looked up at the first call (an advisor is made before other beans).
	 *
	 * @param dataSource the application's DataSource
	 * @param transactionManager its transaction manager
	 * @return the advisor
	 */
	@Bean
	@Role(BeanDefinition.ROLE_INFRASTRUCTURE)
	@ConditionalOnMissingBean(name = "idempotentMethodAdvisor")
	public static Advisor idempotentMethodAdvisor(ObjectProvider<DataSource> dataSource,
			ObjectProvider<PlatformTransactionManager> transactionManager) {
		return new DefaultPointcutAdvisor(AnnotationMatchingPointcut.forMethodAnnotation(Idempotent.class),
				new IdempotentMethodInterceptor(dataSource::getObject, transactionManager::getObject));
	}
}
