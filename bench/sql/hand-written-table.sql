-- The hand-written table of the reference article, as users write it: the
-- key column has the database's default collation, the hash is hex text.
CREATE TABLE idempotency_keys (
	key           text PRIMARY KEY,
	request_hash  text NOT NULL,
	status        text NOT NULL CHECK (status IN ('started', 'completed')),
	response_code int,
	response_body jsonb,
	created_at    timestamptz NOT NULL DEFAULT now()
);
