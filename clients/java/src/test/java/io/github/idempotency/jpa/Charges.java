package io.github.idempotency.jpa;

import org.springframework.data.jpa.repository.JpaRepository;

/** The charges of JpaPaymentsApp, a Spring Data repository. */
public interface Charges extends JpaRepository<Charge, Long> {
}
