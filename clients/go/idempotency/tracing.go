package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// OpenTelemetry spans of claim, complete and release, named and attributed
// alike in every client of the project so that operators can follow a key
// across languages. They carry a hash of the key, never the key, the scope,
// a body or a header value.

// tracerName is the instrumentation scope of the spans: this package.
const tracerName = "github.com/idempotency/idempotency/clients/go/idempotency"

// The span attributes.
const (
	attrOutcome = attribute.Key("idempotency.outcome")  // what the call answered
	attrAttempt = attribute.Key("idempotency.attempt")  // a claim's attempt, when it gives one
	attrKeyHash = attribute.Key("idempotency.key_hash") // KeyHash of the key
)

// What a release span's outcome says.
const (
	outcomeReleased    = "released"  // the claim was deleted
	outcomeNotReleased = "not_owned" // this fence did not hold it any more
)

// KeyHash is what the spans say of a key: the first 16 lowercase hex digits
// of the SHA-256 of its UTF-8 bytes, the same in every client of the
// project.
func KeyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:8])
}

// tracerOf is the package's tracer from tp, or from the global provider
// (otel.GetTracerProvider: a no-op until the app installs an SDK) when tp
// is nil.
func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(tracerName, trace.WithSchemaURL(semconv.SchemaURL))
}

// inSpan runs call inside the span "idempotency."+op of key; the span gets
// the answer that outcome reads off call's result, or call's error.
func inSpan[T any](ctx context.Context, tr trace.Tracer, op, key string,
	call func(context.Context) (T, error), outcome func(T) (string, int)) (T, error) {
	ctx, span := tr.Start(ctx, "idempotency."+op, trace.WithSpanKind(trace.SpanKindInternal))
	defer span.End()
	result, err := call(ctx)
	if !span.IsRecording() {
		return result, err // no SDK: nothing computed
	}
	span.SetAttributes(attrKeyHash.String(KeyHash(key)))
	if err != nil {
		failed(span, err)
		return result, err
	}
	answer, attempt := outcome(result)
	span.SetAttributes(attrOutcome.String(answer))
	if attempt > 0 {
		span.SetAttributes(attrAttempt.Int(attempt))
	}
	return result, nil
}

// failed marks span as failed by err: its SQLSTATE, never its message
// (which may quote the key).
func failed(span trace.Span, err error) {
	code := SQLState(err)
	if code == "" {
		span.SetStatus(codes.Error, "failed without a SQLSTATE")
		return
	}
	span.SetStatus(codes.Error, "SQLSTATE "+code)
	span.SetAttributes(semconv.DBResponseStatusCode(code))
}

// claimOutcome is what a claim span says of t.
func claimOutcome(t *Ticket) (string, int) { return string(t.Outcome), t.Attempt }

// completeOutcome is what a complete span says of its result.
func completeOutcome(result string) (string, int) { return result, 0 }

// releaseOutcome is what a release span says of its result.
func releaseOutcome(released bool) (string, int) {
	if released {
		return outcomeReleased, 0
	}
	return outcomeNotReleased, 0
}
