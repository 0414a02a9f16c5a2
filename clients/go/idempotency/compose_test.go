package idempotency

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The middleware as users compose it with net/http's own and common
// middleware; each order is in the README's table.

// serveChain starts a test server of the handler that chain builds around
// the middleware on db (guard).
func serveChain(t *testing.T, db Pool, opts Options, chain func(guard func(http.Handler) http.Handler) http.Handler) *httptest.Server {
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	opts.OneTransaction = opts.OneTransaction || oneTransaction
	srv := httptest.NewUnstartedServer(chain(newGuard(pgxStore{Pool: db}, opts).middleware))
	srv.Config.ErrorLog = quiet
	srv.Start()
	srv.Client().Timeout = 20 * time.Second
	t.Cleanup(srv.Close)
	return srv
}

// slowOnce is a handler that writes a row for the X-Key header's key; on its
// first run it then waits for its context to end and answers 201 all the
// same (a handler that does not check), later runs answer 201 at once.
func slowOnce(runs *int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := atomic.AddInt32(runs, 1)
		if err := write(r, r.Header.Get("X-Key")); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if n == 1 {
			<-r.Context().Done()
		}
		w.WriteHeader(201)
	}
}

// wantNothingKept fails t unless the key has no record and no writes.
func wantNothingKept(t *testing.T, key string) {
	t.Helper()
	if rec, err := Lookup(ctx, pool, aliceScope, key); rec != nil || err != nil {
		t.Fatalf("the key is held: %+v %v", rec, err)
	}
	if n := writesOf(t, key); n != 0 {
		t.Fatalf("%d writes of a handler that did not finish committed", n)
	}
}

// http.TimeoutHandler inside the middleware answers 503 while the handler
// still runs: its writes roll back and the 503 is not stored, even with
// idempotency.store_server_errors on; the retry runs again.
func TestComposeTimeoutHandlerInside(t *testing.T) {
	on := settingsPool(t, map[string]string{"idempotency.store_server_errors": "on"})
	var runs int32
	srv := serveChain(t, on, Options{}, func(guard func(http.Handler) http.Handler) http.Handler {
		return guard(http.TimeoutHandler(slowOnce(&runs), 200*time.Millisecond, "timed out"))
	})
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 503 || string(r.body) != "timed out" {
		t.Fatalf("first: %d %q; want TimeoutHandler's 503", r.status, r.body)
	}
	wantNothingKept(t, c.header["X-Key"])
	if r := send(t, srv, c); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" || runs != 2 {
		t.Fatalf("retry: %d %v after %d runs; want a second run", r.status, r.header, runs)
	}
}

// http.TimeoutHandler outside the middleware ends the request's context:
// what the handler answers afterwards is not its answer (the client got
// the 503), so its writes roll back and nothing is stored.
func TestComposeTimeoutHandlerOutside(t *testing.T) {
	var runs int32
	ended := make(chan struct{}, 2) // a request's pass through the middleware returned
	srv := serveChain(t, pool, Options{}, func(guard func(http.Handler) http.Handler) http.Handler {
		guarded := guard(slowOnce(&runs))
		return http.TimeoutHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			defer func() { ended <- struct{}{} }()
			guarded.ServeHTTP(w, r)
		}), 200*time.Millisecond, "timed out")
	})
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 503 {
		t.Fatalf("first: %d %q; want TimeoutHandler's 503", r.status, r.body)
	}
	// The middleware ends after the client's answer: wait for it to return.
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the middleware did not return")
	}
	wantNothingKept(t, c.header["X-Key"])
	if r := send(t, srv, c); r.status != 201 || runs != 2 {
		t.Fatalf("retry: %d after %d runs; want a second run", r.status, runs)
	}
}

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatal("timed out")
}

// http.MaxBytesHandler outside: the middleware reads the body through its
// limit, and a body over it is a 413 problem, nothing claimed.
func TestComposeMaxBytesHandler(t *testing.T) {
	var runs int32
	srv := serveChain(t, pool, Options{}, func(guard func(http.Handler) http.Handler) http.Handler {
		return http.MaxBytesHandler(guard(charge(&runs)), 8)
	})
	c := keyed(uniqueKey(t), `{"amount":100}`)
	wantProblem(t, send(t, srv, c), 413, CodeBodyTooLarge)
	if rec, err := Lookup(ctx, pool, aliceScope, c.header["X-Key"]); rec != nil || err != nil || runs != 0 {
		t.Fatalf("record %+v (%v) after %d runs", rec, err, runs)
	}
	if r := send(t, srv, keyed(uniqueKey(t), `{}`)); r.status != 201 {
		t.Fatalf("a body within the limit: %d", r.status)
	}
}

// gzipped compresses every response (Content-Encoding: gzip), as
// compression middleware does for a client that accepts it.
func gzipped(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		var buf bytes.Buffer
		z := gzip.NewWriter(&buf)
		z.Write(rec.Body.Bytes())
		z.Close()
		for name, values := range rec.Header() {
			w.Header()[name] = values
		}
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Del("Content-Length")
		w.WriteHeader(rec.Code)
		w.Write(buf.Bytes())
	})
}

// gunzip is the body of r uncompressed.
func gunzip(t *testing.T, r reply) string {
	t.Helper()
	if r.header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("not compressed: %v", r.header)
	}
	z, err := gzip.NewReader(bytes.NewReader(r.body))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(z)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Compression outside the middleware compresses the first answer and the
// replay alike; inside it, the stored body is compressed, and the
// Content-Encoding that says so is stored with it whatever StoreHeaders says.
func TestComposeCompression(t *testing.T) {
	orders := map[string]func(guard func(http.Handler) http.Handler, h http.Handler) http.Handler{
		"outside": func(guard func(http.Handler) http.Handler, h http.Handler) http.Handler { return gzipped(guard(h)) },
		"inside":  func(guard func(http.Handler) http.Handler, h http.Handler) http.Handler { return guard(gzipped(h)) },
	}
	for name, order := range orders {
		t.Run(name, func(t *testing.T) {
			var runs int32
			srv := serveChain(t, pool, Options{}, func(guard func(http.Handler) http.Handler) http.Handler {
				return order(guard, charge(&runs))
			})
			c := keyed(uniqueKey(t), `{}`)
			c.header["Accept-Encoding"] = "gzip"
			first, again := send(t, srv, c), send(t, srv, c)
			if first.status != 201 || again.status != 201 || gunzip(t, first) != gunzip(t, again) ||
				again.header.Get("Idempotent-Replayed") != "true" || runs != 1 {
				t.Fatalf("first %d, again %d %v after %d runs", first.status, again.status, again.header, runs)
			}
		})
	}
}

type principalKey struct{}

// authenticated is an auth middleware: a bearer token names its user
// ("Bearer alice-2" is a refreshed token of alice); none is 401.
func authenticated(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		user, _, _ := strings.Cut(token, "-")
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, user)))
	})
}

// principalScope is the scope of the authenticated principal.
func principalScope(r *http.Request) string {
	user, _ := r.Context().Value(principalKey{}).(string)
	return "user:" + user
}

// With the scope from the authenticated principal, a retry sent with a
// refreshed token replays; with the default (a hash of Authorization) it is
// another scope, and runs again.
func TestComposeAuthScope(t *testing.T) {
	scopes := map[string]struct {
		scope  func(*http.Request) string
		replay bool
	}{"principal": {principalScope, true}, "default": {nil, false}}
	for name, s := range scopes {
		t.Run(name, func(t *testing.T) {
			var runs int32
			srv := serveChain(t, pool, Options{Scope: s.scope}, func(guard func(http.Handler) http.Handler) http.Handler {
				return authenticated(guard(charge(&runs)))
			})
			c := keyed(uniqueKey(t), `{}`)
			send(t, srv, c)
			c.header["Authorization"] = "Bearer alice-2" // the token was refreshed
			r := send(t, srv, c)
			if replayed := r.header.Get("Idempotent-Replayed") == "true"; r.status != 201 || replayed != s.replay {
				t.Fatalf("retry after the refresh: %d %v after %d runs; want replayed %v", r.status, r.header, runs, s.replay)
			}
		})
	}
}

// traced is tracing middleware: it records each request's status, as
// otelhttp's handler does around what it wraps.
func traced(statuses *[]int) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			sw := &statusWriter{ResponseWriter: w}
			next.ServeHTTP(sw, r)
			*statuses = append(*statuses, sw.status)
		})
	}
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(status int) {
	s.status = status
	s.ResponseWriter.WriteHeader(status)
}

// Tracing outside the middleware sees every answer, the replay and the 409
// problems included; inside, only the runs of the handler.
func TestComposeTracing(t *testing.T) {
	var outside, inside []int
	var runs int32
	srv := serveChain(t, pool, Options{}, func(guard func(http.Handler) http.Handler) http.Handler {
		return traced(&outside)(guard(traced(&inside)(charge(&runs))))
	})
	c := keyed(uniqueKey(t), `{}`)
	send(t, srv, c)
	send(t, srv, c)
	send(t, srv, call{path: "/payments", body: "{}"}) // no key: 400
	if len(outside) != 3 || outside[0] != 201 || outside[1] != 201 || outside[2] != 400 ||
		len(inside) != 1 || inside[0] != 201 {
		t.Fatalf("traced outside %v, inside %v", outside, inside)
	}
}
