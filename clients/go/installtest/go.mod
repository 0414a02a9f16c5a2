module github.com/idempotency/idempotency/clients/go/installtest

go 1.26.0

require golang.org/x/mod v0.43.0
