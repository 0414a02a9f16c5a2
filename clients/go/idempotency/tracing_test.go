package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// recording returns a tracer provider of the OpenTelemetry SDK whose spans
// land, as they end, in the returned in-memory exporter.
func recording(t *testing.T) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { tp.Shutdown(ctx) })
	return tp, exporter
}

// spanWant is what a span must say; attempt 0: no attempt attribute; code
// "": no error.
type spanWant struct {
	name, outcome string
	attempt       int
	code          string
}

// takeSpans checks the spans of the package exported since the last call
// against want, in order, for key, and that nothing in them holds the key or
// one of secrets. With parented, each must be the child of a span (the
// request's).
func takeSpans(t *testing.T, exporter *tracetest.InMemoryExporter, parented bool, key string, secrets []string, want ...spanWant) {
	t.Helper()
	var spans tracetest.SpanStubs
	for _, s := range exporter.GetSpans() {
		if strings.HasPrefix(s.Name, "idempotency.") {
			spans = append(spans, s)
		}
	}
	exporter.Reset()
	if len(spans) != len(want) {
		t.Fatalf("%d spans %v, want %d", len(spans), spanNames(spans), len(want))
	}
	sum := sha256.Sum256([]byte(key))
	for i, s := range spans {
		attrs := attributes(s)
		w := want[i]
		got := spanWant{s.Name, attrs[attrOutcome].AsString(), int(attrs[attrAttempt].AsInt64()),
			attrs["db.response.status_code"].AsString()}
		if w.code != "" {
			w.outcome = "" // a failed call has no answer
		}
		if got != w || s.SpanKind != trace.SpanKindInternal ||
			attrs[attrKeyHash].AsString() != hex.EncodeToString(sum[:])[:16] ||
			(s.Status.Code == codes.Error) != (w.code != "") ||
			s.InstrumentationScope.Name != tracerName ||
			parented != (s.Parent.IsValid() && s.Parent.TraceID() == s.SpanContext.TraceID()) {
			t.Fatalf("span %d: %s %v %v %v (parent %v), want %+v", i, s.Name, s.SpanKind, s.Status, s.Attributes,
				s.Parent.SpanID(), w)
		}
		for _, secret := range append(secrets, key) {
			if text := spanText(s); strings.Contains(text, secret) {
				t.Fatalf("span %s holds %q: %s", s.Name, secret, text)
			}
		}
	}
}

// attributes maps the span's attributes by key.
func attributes(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// spanText is everything the span says, as text: name, status, attributes,
// events, links and resource.
func spanText(s tracetest.SpanStub) string {
	var b strings.Builder
	b.WriteString(s.Name + " " + s.Status.Description)
	kvs := append([]attribute.KeyValue{}, s.Attributes...)
	for _, e := range s.Events {
		b.WriteString(" " + e.Name)
		kvs = append(kvs, e.Attributes...)
	}
	for _, l := range s.Links {
		kvs = append(kvs, l.Attributes...)
	}
	if s.Resource != nil {
		kvs = append(kvs, s.Resource.Attributes()...)
	}
	for _, kv := range kvs {
		b.WriteString(" " + string(kv.Key) + "=" + kv.Value.Emit())
	}
	return b.String()
}

// spanNames lists the names of spans.
func spanNames(spans tracetest.SpanStubs) []string {
	var names []string
	for _, s := range spans {
		names = append(names, s.Name)
	}
	return names
}

// serveTraced starts a test server of h behind the middleware (one
// transaction or two) whose spans go to tp, behind tracing middleware that
// starts a span per request.
func serveTraced(t *testing.T, tp trace.TracerProvider, one bool, h http.HandlerFunc) *httptest.Server {
	guarded := newGuard(pgxStore{Pool: pool}, Options{TracerProvider: tp, OneTransaction: one, Logger: quiet}).middleware(h)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tp.Tracer("test").Start(r.Context(), "request")
		defer span.End()
		guarded.ServeHTTP(w, r.WithContext(ctx))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// The middleware's spans, in both modes, on the tracer provider of its
// options, children of the request's span: a fresh request, its replay, a mismatch, a 5xx that is released,
// and a response too large to store (54000).
func TestTracingMiddleware(t *testing.T) {
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			tp, exporter := recording(t)
			var runs int32
			srv := serveTraced(t, tp, one, func(w http.ResponseWriter, r *http.Request) {
				switch r.Header.Get("X-Answer") {
				case "500":
					w.WriteHeader(500)
				case "huge":
					w.Write(make([]byte, 1<<20+1)) // over idempotency.max_response_bytes
				default:
					charge(&runs)(w, r)
				}
			})
			body := `{"card":"4242-` + hex.EncodeToString([]byte(t.Name())) + `"}`
			secrets := []string{body, "Bearer alice", aliceScope}
			c := keyed(uniqueKey(t), body)
			key := c.header["X-Key"]
			if r := send(t, srv, c); r.status != 201 {
				t.Fatalf("fresh: %d %s", r.status, r.body)
			}
			takeSpans(t, exporter, true, key, secrets,
				spanWant{name: "idempotency.claim", outcome: "new", attempt: 1},
				spanWant{name: "idempotency.complete", outcome: "stored"})
			if r := send(t, srv, c); r.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay: %d %v", r.status, r.header)
			}
			takeSpans(t, exporter, true, key, secrets, spanWant{name: "idempotency.claim", outcome: "replay"})
			other := keyed(key, `{"card":"other"}`)
			if r := send(t, srv, other); r.status != 422 {
				t.Fatalf("mismatch: %d", r.status)
			}
			takeSpans(t, exporter, true, key, secrets, spanWant{name: "idempotency.claim", outcome: "mismatch"})

			failing := keyed(uniqueKey(t), body)
			failing.header["X-Answer"] = "500"
			if r := send(t, srv, failing); r.status != 500 {
				t.Fatalf("5xx: %d", r.status)
			}
			spans := []spanWant{{name: "idempotency.claim", outcome: "new", attempt: 1}}
			if one { // the claim rolled back with the handler's writes: made again for complete
				spans = append(spans, spans[0])
			}
			spans = append(spans, spanWant{name: "idempotency.complete", outcome: "released"})
			takeSpans(t, exporter, true, failing.header["X-Key"], secrets, spans...)

			huge := keyed(uniqueKey(t), body)
			huge.header["X-Answer"] = "huge"
			if r := send(t, srv, huge); r.status != 503 {
				t.Fatalf("too large: %d", r.status)
			}
			spans = []spanWant{{name: "idempotency.claim", outcome: "new", attempt: 1},
				{name: "idempotency.complete", code: "54000"}}
			if !one { // the claim committed on its own: freed for the retry
				spans = append(spans, spanWant{name: "idempotency.release", outcome: "released"})
			}
			takeSpans(t, exporter, true, huge.header["X-Key"], secrets, spans...)
		})
	}
}

// Claim, Complete and Release on their own go to the global tracer
// provider; a refused call records its SQLSTATE.
func TestTracingGlobalProvider(t *testing.T) {
	tp, exporter := recording(t)
	otel.SetTracerProvider(tp)
	defer otel.SetTracerProvider(noop.NewTracerProvider())
	key, secret := uniqueKey(t), "the response body"
	p := ClaimParams{Key: key, Fingerprint: fp("1")}

	first := mustClaim(t, p, New)
	if _, err := first.Complete(ctx, pool, 201, []byte(secret), nil); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, p, Replay)
	if _, err := first.Complete(ctx, pool, 201, nil, nil); SQLState(err) != codeClaimLost {
		t.Fatalf("complete again: %v", err)
	}
	takeSpans(t, exporter, false, key, []string{secret},
		spanWant{name: "idempotency.claim", outcome: "new", attempt: 1},
		spanWant{name: "idempotency.complete", outcome: "stored"},
		spanWant{name: "idempotency.claim", outcome: "replay"},
		spanWant{name: "idempotency.complete", code: codeClaimLost})

	p.Key = uniqueKey(t)
	held := mustClaim(t, p, New)
	for range 2 {
		held.Release(ctx, pool)
	}
	takeSpans(t, exporter, false, p.Key, nil,
		spanWant{name: "idempotency.claim", outcome: "new", attempt: 1},
		spanWant{name: "idempotency.release", outcome: "released"},
		spanWant{name: "idempotency.release", outcome: "not_owned"})

	p.Key = strings.Repeat("k", 256) // over 255 bytes
	if _, err := Claim(ctx, pool, p); SQLState(err) != codeInvalidArg {
		t.Fatalf("claim of a long key: %v", err)
	}
	takeSpans(t, exporter, false, p.Key, nil, spanWant{name: "idempotency.claim", code: codeInvalidArg})
}

// batchTracer is a pgx.QueryTracer and pgx.BatchTracer that keeps the
// statements of the batches it sees, as otelpgx would trace them.
type batchTracer struct {
	mu         sync.Mutex
	statements []string
}

func (b *batchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (b *batchTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (b *batchTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (b *batchTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.statements = append(b.statements, strings.Fields(data.SQL)[0]+" "+data.CommandTag.String())
}
func (b *batchTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// The pool's pgx tracer sees the package's batches (BEGIN with the claim,
// complete with COMMIT), which do not go through pgx's SendBatch.
func TestTracingPgxBatchTracer(t *testing.T) {
	want := map[bool]string{
		false: "BEGIN BEGIN,SELECT SELECT 1,COMMIT COMMIT",                 // BEGIN; complete, COMMIT
		true:  "BEGIN BEGIN,SELECT SELECT 1,SELECT SELECT 1,COMMIT COMMIT", // BEGIN, claim; complete, COMMIT
	}
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			tracer := &batchTracer{}
			cfg := pool.Config()
			cfg.ConnConfig.Tracer = tracer
			traced, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer traced.Close()
			var runs int32
			srv := serveMode(t, traced, one, Options{}, charge(&runs))
			if r := send(t, srv, keyed(uniqueKey(t), `{}`)); r.status != 201 {
				t.Fatalf("fresh: %d", r.status)
			}
			tracer.mu.Lock()
			defer tracer.mu.Unlock()
			if got := strings.Join(tracer.statements, ","); got != want[one] {
				t.Fatalf("the pgx tracer saw %q, want %q", got, want[one])
			}
		})
	}
}

// Run's spans are the middleware's: a fresh call's claim and complete, a
// duplicate's claim, a failed call's claim (and, in two transactions, its
// release); none holds the key or the arguments.
func TestTracingRun(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			tp, exporter := recording(t)
			o.TracerProvider = tp
			card := "4242-" + hex.EncodeToString([]byte(t.Name()))
			key := uniqueKey(t)
			w := Work{Scope: "tenant-secret", Key: key, Args: map[string]string{"card": card}}
			var runs int32
			for i := 0; i < 2; i++ {
				if _, err := Run(ctx, pool, w, charging(key, 1, &runs), o); err != nil {
					t.Fatal(err)
				}
			}
			secrets := []string{card, "tenant-secret"}
			takeSpans(t, exporter, false, key, secrets,
				spanWant{name: "idempotency.claim", outcome: "new", attempt: 1},
				spanWant{name: "idempotency.complete", outcome: "stored"},
				spanWant{name: "idempotency.claim", outcome: "replay"})
			failed := uniqueKey(t)
			w.Key = failed
			Run(ctx, pool, w, func(context.Context, pgx.Tx) (int, error) { return 0, errDeclined }, o)
			spans := []spanWant{{name: "idempotency.claim", outcome: "new", attempt: 1}}
			if o.TwoTransactions {
				spans = append(spans, spanWant{name: "idempotency.release", outcome: "released"})
			}
			takeSpans(t, exporter, false, failed, secrets, spans...)
		})
	}
}
