package io.github.idempotency.jpa;

import jakarta.persistence.Column;
import jakarta.persistence.Entity;
import jakarta.persistence.GeneratedValue;
import jakarta.persistence.GenerationType;
import jakarta.persistence.Id;
import jakarta.persistence.SequenceGenerator;
import jakarta.persistence.Table;

/** A charge of JpaPaymentsApp; its id comes from a sequence, so that its INSERT waits for the flush. */
@Entity
@Table(name = "jpa_charges")
public class Charge {
	@Id
	@GeneratedValue(strategy = GenerationType.SEQUENCE, generator = "jpa_charges")
	@SequenceGenerator(name = "jpa_charges", sequenceName = "jpa_charges_seq", allocationSize = 1)
	private Long id;
	private long amount;
	@Column(unique = true)
	private String reference;

	/** For JPA. */
	protected Charge() {
	}

	/** A charge of amount, with its unique reference. */
	Charge(long amount, String reference) {
		this.amount = amount;
		this.reference = reference;
	}

	/** Its id, once saved. */
	Long id() {
		return id;
	}
}
