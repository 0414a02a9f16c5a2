package io.github.idempotency.spring;

import io.github.idempotency.function.FunctionOptions;
import io.github.idempotency.function.IdempotentFunction;
import java.lang.reflect.Method;
import java.lang.reflect.UndeclaredThrowableException;
import java.time.Duration;
import java.util.Arrays;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Supplier;
import javax.sql.DataSource;
import org.aopalliance.intercept.MethodInterceptor;
import org.aopalliance.intercept.MethodInvocation;
import org.springframework.aop.support.AopUtils;
import org.springframework.boot.convert.DurationStyle;
import org.springframework.context.expression.MethodBasedEvaluationContext;
import org.springframework.core.DefaultParameterNameDiscoverer;
import org.springframework.core.ParameterNameDiscoverer;
import org.springframework.core.annotation.AnnotatedElementUtils;
import org.springframework.expression.Expression;
import org.springframework.expression.spel.standard.SpelExpressionParser;
import org.springframework.transaction.PlatformTransactionManager;

/** Runs the methods annotated {@link Idempotent} through the idempotent function. */
public final class IdempotentMethodInterceptor implements MethodInterceptor {
	private static final SpelExpressionParser PARSER = new SpelExpressionParser();
	private static final ParameterNameDiscoverer NAMES = new DefaultParameterNameDiscoverer();

	private final Supplier<DataSource> dataSource;
	private final Supplier<PlatformTransactionManager> transactionManager;
	private final Map<String, Expression> expressions = new ConcurrentHashMap<>();

	/**
	 * The interceptor, looking the DataSource and the transaction manager up at its first call.
	 *
	 * @param dataSource the application's DataSource
	 * @param transactionManager its transaction manager
	 */
	public IdempotentMethodInterceptor(Supplier<DataSource> dataSource,
			Supplier<PlatformTransactionManager> transactionManager) {
		this.dataSource = dataSource;
		this.transactionManager = transactionManager;
	}

	@Override
	public Object invoke(MethodInvocation invocation) throws Throwable {
		Object target = invocation.getThis();
		Method method = target == null ? invocation.getMethod()
				: AopUtils.getMostSpecificMethod(invocation.getMethod(), target.getClass());
		Idempotent a = AnnotatedElementUtils.findMergedAnnotation(method, Idempotent.class);
		if (a == null) {
			return invocation.proceed();
		}
		MethodBasedEvaluationContext context =
				new MethodBasedEvaluationContext(target, method, invocation.getArguments(), NAMES);
		String key = evaluate(a.key(), context);
		FunctionOptions<Object> options = FunctionOptions.ofType(method.getGenericReturnType())
				.args(invocation.getArguments())
				.scope(a.scope().isEmpty() ? "" : evaluate(a.scope(), context))
				.oneTransaction(a.oneTransaction())
				.lease(duration(a.lease()))
				.retention(duration(a.retention()))
				.waitFor(duration(a.waitFor()))
				.finalErrors(e -> Arrays.stream(a.finalErrors()).anyMatch(c -> c.isInstance(e)));
		DataSource ds = dataSource.get();
		return IdempotentFunction.run(ds, new SpringRequestTransactions(transactionManager.get(), ds), key, options,
				tx -> proceed(invocation));
	}

	/** The value of SpEL expression text, as a string. */
	private String evaluate(String text, MethodBasedEvaluationContext context) {
		Object value = expressions.computeIfAbsent(text, PARSER::parseExpression).getValue(context);
		if (value == null) {
			throw new IllegalArgumentException("idempotency: @Idempotent's expression " + text + " is null");
		}
		return value.toString();
	}

	/** text as a duration ("2s", "500ms", ISO-8601); null for empty. */
	private static Duration duration(String text) {
		return text.isEmpty() ? null : DurationStyle.detectAndParse(text);
	}

	/** Runs the method, its checked errors as they are. */
	private static Object proceed(MethodInvocation invocation) throws Exception {
		try {
			return invocation.proceed();
		} catch (Exception | Error e) {
			throw e;
		} catch (Throwable t) {
			throw new UndeclaredThrowableException(t);
		}
	}
}
