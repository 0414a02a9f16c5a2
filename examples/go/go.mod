module github.com/idempotency/idempotency/examples/go

go 1.19

require (
	github.com/idempotency/idempotency/clients/go v0.0.0
	github.com/jackc/pgx/v4 v4.15.0
)

// The client package of this repository, not a published version.
replace github.com/idempotency/idempotency/clients/go => ../../clients/go
