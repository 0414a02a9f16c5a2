package io.github.idempotency.spring;

import io.github.idempotency.TransactionCommands;
import io.github.idempotency.servlet.RequestTransactions;
import java.lang.System.Logger.Level;
import java.sql.Connection;
import javax.sql.DataSource;
import org.springframework.jdbc.datasource.DataSourceUtils;
import org.springframework.transaction.PlatformTransactionManager;
import org.springframework.transaction.TransactionDefinition;
import org.springframework.transaction.TransactionStatus;
import org.springframework.transaction.support.DefaultTransactionDefinition;
import org.springframework.transaction.support.TransactionSynchronization;
import org.springframework.transaction.support.TransactionSynchronizationManager;

/**
 * The handler's transaction from Spring's transaction manager, bound to the request's thread: the
 * handler's JdbcTemplate, JdbcClient, JPA repositories and {@code @Transactional} methods (propagation
 * REQUIRED, the default) join it, and {@code complete} runs on its connection, so that they commit
 * together.
 */
public final class SpringRequestTransactions implements RequestTransactions {
	private static final System.Logger LOG = System.getLogger(SpringRequestTransactions.class.getName());

	private final PlatformTransactionManager transactionManager;
	private final DataSource dataSource;

	/**
	 * Transactions of {@code transactionManager}, which must bind connections of {@code dataSource}
	 * (DataSourceTransactionManager, JdbcTransactionManager, JpaTransactionManager do).
	 *
	 * @param transactionManager the application's transaction manager
	 * @param dataSource the DataSource it manages
	 */
	public SpringRequestTransactions(PlatformTransactionManager transactionManager, DataSource dataSource) {
		this.transactionManager = transactionManager;
		this.dataSource = dataSource;
	}

	@Override
	public RequestTransaction begin() {
		DefaultTransactionDefinition definition =
				new DefaultTransactionDefinition(TransactionDefinition.PROPAGATION_REQUIRES_NEW);
		definition.setName("idempotency");
		TransactionStatus status = transactionManager.getTransaction(definition);
		if (!TransactionSynchronizationManager.hasResource(dataSource)) {
			transactionManager.rollback(status);
			throw new IllegalStateException("idempotency: the transaction manager does not bind connections of "
					+ "the DataSource, so complete could not commit with the handler's writes");
		}
		Connection bound = DataSourceUtils.getConnection(dataSource);
		TransactionSynchronizationManager.registerSynchronization(new UnnamedTransactionCommands(bound));
		return new RequestTransaction() {
			@Override
			public Connection connection() {
				return DataSourceUtils.getConnection(dataSource);
			}

			@Override
			public boolean readyToComplete() {
				status.flush();
				return TransactionSynchronizationManager.getSynchronizations().stream()
						.allMatch(UnnamedTransactionCommands.class::isInstance);
			}

			@Override
			public void commit() {
				transactionManager.commit(status);
			}

			@Override
			public void rollback() {
				if (status.isCompleted()) {
					return;
				}
				try {
					transactionManager.rollback(status);
				} catch (RuntimeException e) {
					LOG.log(Level.WARNING, "idempotency: rollback: " + e);
				}
			}
		};
	}

	/**
	 * Sends the transaction's COMMIT or ROLLBACK as an unnamed statement (through pgbouncer before 1.21,
	 * see {@link TransactionCommands}), and gives the connection its own setting back before the
	 * transaction manager releases it.
	 */
	private static final class UnnamedTransactionCommands implements TransactionSynchronization {
		private final Connection connection;
		private int saved = -1;

		UnnamedTransactionCommands(Connection connection) {
			this.connection = connection;
		}

		@Override
		public void beforeCompletion() {
			saved = TransactionCommands.unnamed(connection);
		}

		@Override
		public void afterCompletion(int status) {
			TransactionCommands.restore(connection, saved);
		}
	}
}
