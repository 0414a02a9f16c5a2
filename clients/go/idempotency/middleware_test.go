package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// quiet is the logger of the middleware under test.
var quiet = log.New(io.Discard, "", 0)

// reply is a response as the client saw it.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// call is one request: key lines (nil: no Idempotency-Key field) and headers.
type call struct {
	method, path, body string
	keys               []string
	header             map[string]string
}

// send makes the request c to srv; a request that gets no response fails t
// and returns status 0. It may run in a goroutine of its own.
func send(t *testing.T, srv *httptest.Server, c call) reply {
	t.Helper()
	if c.method == "" {
		c.method = http.MethodPost
	}
	req, err := http.NewRequest(c.method, srv.URL+c.path, strings.NewReader(c.body))
	if err != nil {
		t.Error(err)
		return reply{}
	}
	if c.keys != nil {
		req.Header["Idempotency-Key"] = c.keys
	}
	for name, value := range c.header {
		req.Header.Set(name, value)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Error(err)
		return reply{}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Error(err)
	}
	return reply{resp.StatusCode, resp.Header, body}
}

// serve starts a test server of handler h behind the middleware.
func serve(t *testing.T, db Pool, opts Options, h http.HandlerFunc) *httptest.Server {
	return serveGuarded(t, pgxStore{Pool: db, prepare: opts.Prepare || prepareAll}, opts, h)
}

// serveGuarded starts a test server of handler h behind the middleware on db.
func serveGuarded(t *testing.T, db store, opts Options, h http.HandlerFunc) *httptest.Server {
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	if oneTransaction {
		opts.OneTransaction = true
		if opts.Wait == 0 {
			opts.Wait = 300 * time.Millisecond // the tests that hold a key expect 409 soon
		}
	}
	srv := httptest.NewUnstartedServer(newGuard(db, opts).middleware(h))
	srv.Config.ErrorLog = quiet
	srv.Start()
	srv.Client().Timeout = 20 * time.Second // a handler that never answers fails the test
	t.Cleanup(srv.Close)
	return srv
}

// gate holds handlers until it opens. It opens when the test ends too, so
// that a failed test does not leave a handler blocked.
type gate struct {
	once sync.Once
	ch   chan struct{}
}

// newGate returns a closed gate, opened by t's cleanup at the latest; make
// it after the server, whose cleanup waits for the handlers.
func newGate(t *testing.T) *gate {
	g := &gate{ch: make(chan struct{})}
	t.Cleanup(g.open)
	return g
}

// open lets every waiting and later handler through.
func (g *gate) open() { g.once.Do(func() { close(g.ch) }) }

// wait blocks until the gate opens.
func (g *gate) wait() { <-g.ch }

// receive returns the next value of ch, failing t after 10 seconds.
func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("timed out")
		panic("unreachable")
	}
}

// wantProblem fails t unless r is a problem+json with this status and code.
func wantProblem(t *testing.T, r reply, status int, code string) {
	t.Helper()
	var p problem
	if r.status != status || r.header.Get("Content-Type") != "application/problem+json" ||
		json.Unmarshal(r.body, &p) != nil || p.Status != status || p.Code != code ||
		p.Type != "about:blank" || p.Title != titles[status] || p.Detail == "" {
		t.Fatalf("want a %d problem %s, got %d %s %s", status, code, r.status,
			r.header.Get("Content-Type"), r.body)
	}
}

// wantRetryAfter fails t unless r has Retry-After between min and max seconds.
func wantRetryAfter(t *testing.T, r reply, min, max int) {
	t.Helper()
	var s int
	if _, err := fmt.Sscan(r.header.Get("Retry-After"), &s); err != nil || s < min || s > max {
		t.Fatalf("Retry-After %q, want %d..%d", r.header.Get("Retry-After"), min, max)
	}
}

// writesOf counts the rows the handlers wrote for key.
func writesOf(t *testing.T, key string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM writes WHERE key = $1`, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// write inserts a row for key through the request's transaction (Tx, or
// SQLTx behind MiddlewareSQL).
func write(r *http.Request, key string) error {
	attempt := 0
	if t := TicketFrom(r.Context()); t != nil {
		attempt = t.Attempt
	}
	const insert = `INSERT INTO writes VALUES ($1, $2)`
	if tx := SQLTx(r.Context()); tx != nil {
		_, err := tx.ExecContext(r.Context(), insert, key, attempt)
		return err
	}
	_, err := Tx(r.Context()).Exec(r.Context(), insert, key, attempt)
	return err
}

// charge is a handler: writes a row for the X-Key header's key, answers 201
// with the body, stored and unstored headers and a few raw bytes.
func charge(runs *int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := atomic.AddInt32(runs, 1)
		body, _ := io.ReadAll(r.Body)
		if err := write(r, r.Header.Get("X-Key")); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/payments/%d", n))
		w.Header().Set("X-Trace", fmt.Sprint(n))
		w.Header().Set("Set-Cookie", "session=secret")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d,"echo":%q}`+"\x00\xff", n, body)
	}
}

// aliceScope is the scope of the requests keyed makes.
var aliceScope = CredentialScope(&http.Request{Header: http.Header{"Authorization": {"Bearer alice"}}})

// keyed returns a call of key, written as its Idempotency-Key field.
func keyed(key, body string) call {
	return call{path: "/payments", body: body, keys: []string{`"` + key + `"`},
		header: map[string]string{"X-Key": key, "Authorization": "Bearer alice"}}
}

func TestMiddlewareNewThenReplay(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{StoreHeaders: []string{"Content-Type", "Location", "Set-Cookie"}}, charge(&runs))
	key := uniqueKey(t)
	c := keyed(key, `{"amount":10}`)
	c.path = "/payments?currency=eur"
	first := send(t, srv, c)
	if first.status != 201 || first.header.Get("Location") != "/payments/1" ||
		first.header.Get("Idempotent-Replayed") != "" || writesOf(t, key) != 1 {
		t.Fatalf("first: %d %v %q", first.status, first.header, first.body)
	}
	if want := `{"run":1,"echo":"{\"amount\":10}"}` + "\x00\xff"; string(first.body) != want {
		t.Fatalf("first body %q, want %q", first.body, want)
	}
	r, err := Lookup(ctx, pool, aliceScope, key)
	if err != nil || r == nil || r.State != "completed" {
		t.Fatalf("record: %+v, %v", r, err)
	}
	var want []byte
	if err := pool.QueryRow(ctx, `SELECT idempotency.fingerprint('POST', '/payments', $1, 'currency=eur')`,
		[]byte(`{"amount":10}`)).Scan(&want); err != nil || !bytes.Equal(r.Fingerprint, want) {
		t.Fatalf("stored fingerprint %x, want %x (%v)", r.Fingerprint, want, err)
	}

	for _, keyField := range []string{`"` + key + `"`, key, " \t" + key} {
		c.keys = []string{keyField}
		again := send(t, srv, c)
		if again.status != 201 || !bytes.Equal(again.body, first.body) ||
			again.header.Get("Idempotent-Replayed") != "true" ||
			again.header.Get("Content-Type") != "application/json" ||
			again.header.Get("Location") != "/payments/1" ||
			again.header.Get("X-Trace") != "" || again.header.Get("Set-Cookie") != "" {
			t.Fatalf("replay with %q: %d %v %q", keyField, again.status, again.header, again.body)
		}
	}
	if runs != 1 || writesOf(t, key) != 1 {
		t.Fatalf("%d runs, %d writes; want 1 and 1", runs, writesOf(t, key))
	}
}

func TestMiddlewareFingerprintOfEmptyParts(t *testing.T) {
	srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("no type set")) // net/http would sniff text/plain
	})
	key := uniqueKey(t)
	r := send(t, srv, call{path: "/p?", keys: []string{key}})
	if r.status != 200 || r.header.Get("Content-Type") != "text/plain; charset=utf-8" {
		t.Fatalf("first: %d %v", r.status, r.header)
	}
	rec, err := Lookup(ctx, pool, "", key)
	if err != nil || rec == nil {
		t.Fatalf("no record: %v", err)
	}
	var want []byte
	if err := pool.QueryRow(ctx, `SELECT idempotency.fingerprint('POST', '/p', NULL, NULL)`).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(rec.Fingerprint, want) {
		t.Fatalf("an empty body and query are not NULL in the fingerprint: %x, want %x", rec.Fingerprint, want)
	}
	if got := rec.Header.Get("Content-Type"); got != r.header.Get("Content-Type") {
		t.Fatalf("stored Content-Type %q, sent %q", got, r.header.Get("Content-Type"))
	}
}

func TestMiddlewareInformationalStatusIsNotKept(t *testing.T) {
	srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusAccepted)
	})
	c := keyed(uniqueKey(t), `{}`)
	for _, replayed := range []string{"", "true"} {
		if r := send(t, srv, c); r.status != 202 || r.header.Get("Idempotent-Replayed") != replayed {
			t.Fatalf("%d %v, want 202 (replayed %q)", r.status, r.header, replayed)
		}
	}
}

func TestMiddlewareInProgress(t *testing.T) {
	var proceed *gate
	started := make(chan bool, 1)
	srv := serve(t, pool, Options{Lease: 20 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
		started <- true
		proceed.wait()
		w.WriteHeader(201)
	})
	proceed = newGate(t)
	c := keyed(uniqueKey(t), `{}`)
	first := make(chan reply, 1)
	go func() { first <- send(t, srv, c) }()
	receive(t, started)
	busy := send(t, srv, c)
	wantProblem(t, busy, 409, CodeKeyInProgress)
	wantRetryAfter(t, busy, 1, 20)
	proceed.open()
	if r := receive(t, first); r.status != 201 {
		t.Fatalf("first: %d", r.status)
	}
}

func TestMiddlewareMismatch(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{"amount":10}`)
	send(t, srv, c)
	other := c
	other.body = `{"amount":99}`
	wantProblem(t, send(t, srv, other), 422, CodeKeyMismatch)
	other = c
	other.path = "/payments?x=1"
	wantProblem(t, send(t, srv, other), 422, CodeKeyMismatch)
	other = c
	other.method = http.MethodPatch
	wantProblem(t, send(t, srv, other), 422, CodeKeyMismatch)
	if runs != 1 {
		t.Fatalf("%d runs, want 1", runs)
	}
}

func TestMiddlewareKeyMissingOrMalformed(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{}, charge(&runs))
	wantProblem(t, send(t, srv, call{path: "/p", body: "{}"}), 400, CodeKeyMissing)
	for _, lines := range [][]string{{`"unterminated`}, {`"abc";x=1`}, {`?1`}, {`:YWJj:`},
		{`(a b)`}, {`""`}, {``}, {`"a\qb"`}, {`"a", "b"`}, {`a b`}, {`"a"`, `"b"`},
		{`"` + strings.Repeat("k", 256) + `"`}} {
		wantProblem(t, send(t, srv, call{path: "/p", body: "{}", keys: lines}), 400, CodeKeyInvalid)
	}
	if runs != 0 {
		t.Fatalf("the handler ran %d times", runs)
	}
}

func TestMiddlewareKeyOptional(t *testing.T) {
	key := uniqueKey(t)
	srv := serve(t, pool, Options{KeyOptional: true}, func(w http.ResponseWriter, r *http.Request) {
		if TicketFrom(r.Context()) != nil || write(r, key) != nil {
			w.WriteHeader(500)
			return
		}
		w.WriteHeader(201)
	})
	for i := 1; i <= 2; i++ {
		if r := send(t, srv, call{path: "/p", body: "{}"}); r.status != 201 || writesOf(t, key) != i {
			t.Fatalf("request %d without a key: %d, %d writes", i, r.status, writesOf(t, key))
		}
	}
	wantProblem(t, send(t, srv, call{path: "/p", keys: []string{"(a)"}}), 400, CodeKeyInvalid)
}

func TestMiddlewareOtherMethodsPassThrough(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&runs, 1)
		if Tx(r.Context()) != nil {
			w.WriteHeader(500)
		}
	})
	for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		if r := send(t, srv, call{method: m, path: "/p"}); r.status != 200 {
			t.Fatalf("%s: %d", m, r.status)
		}
	}
	srv = serve(t, pool, Options{Methods: []string{"put"}}, func(http.ResponseWriter, *http.Request) {})
	wantProblem(t, send(t, srv, call{method: http.MethodPut, path: "/p"}), 400, CodeKeyMissing)
	if r := send(t, srv, call{method: http.MethodPost, path: "/p"}); r.status != 200 {
		t.Fatalf("POST when only PUT is covered: %d", r.status)
	}
	if runs != 3 {
		t.Fatalf("%d runs, want 3", runs)
	}
}

func TestMiddlewareScopeIsTheCredentialsHash(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{}, charge(&runs))
	key := uniqueKey(t)
	hash := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return hex.EncodeToString(sum[:])
	}
	callers := []struct {
		header map[string]string
		scope  string
	}{
		{map[string]string{"Authorization": "Bearer alice"}, hash("authorization:Bearer alice")},
		{map[string]string{"Authorization": "Bearer bob", "X-API-Key": "k"}, hash("authorization:Bearer bob")},
		{map[string]string{"X-API-Key": "k1"}, hash("x-api-key:k1")},
		{map[string]string{}, ""},
	}
	for i, c := range callers {
		c.header["X-Key"] = key
		r := send(t, srv, call{path: "/p", body: "{}", keys: []string{key}, header: c.header})
		if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" || runs != int32(i+1) {
			t.Fatalf("caller %d: %d %v", i, r.status, r.header)
		}
		rec, err := Lookup(ctx, pool, c.scope, key)
		if err != nil || rec == nil {
			t.Fatalf("caller %d: no record in scope %q (%v)", i, c.scope, err)
		}
	}
	var leaked int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency.keys
		WHERE key = $1 AND (scope ~ 'alice|bob|k1' OR headers::text ~ 'alice|bob')`, key).Scan(&leaked)
	if err != nil || leaked != 0 {
		t.Fatalf("%d records hold a credential (%v)", leaked, err)
	}
}

// declining returns a handler that writes a row for the X-Key header's key
// and answers 502 "declined <run>" as text/plain.
func declining(runs *int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := atomic.AddInt32(runs, 1)
		write(r, r.Header.Get("X-Key"))
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusBadGateway)
		fmt.Fprintf(w, "declined %d", n)
	}
}

// wantReleasedTwice sends c twice to srv, whose handler is declining: each
// attempt runs, answers its own 502 and leaves neither its key nor its writes.
func wantReleasedTwice(t *testing.T, srv *httptest.Server, c call) {
	t.Helper()
	for i := 1; i <= 2; i++ {
		r := send(t, srv, c)
		if r.status != 502 || string(r.body) != fmt.Sprintf("declined %d", i) ||
			r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("attempt %d: %d %q", i, r.status, r.body)
		}
		if rec, err := Lookup(ctx, pool, aliceScope, c.header["X-Key"]); rec != nil || err != nil {
			t.Fatalf("attempt %d: the key is still held: %+v %v", i, rec, err)
		}
	}
	if n := writesOf(t, c.header["X-Key"]); n != 0 {
		t.Fatalf("%d writes of failed requests committed", n)
	}
}

func TestMiddlewareServerErrorRollsBackAndReleases(t *testing.T) {
	pools := map[string]Pool{"default": pool,
		"store_server_errors off": settingsPool(t, map[string]string{"idempotency.store_server_errors": "off"})}
	for name, db := range pools {
		t.Run(name, func(t *testing.T) {
			var runs int32
			wantReleasedTwice(t, serve(t, db, Options{}, declining(&runs)), keyed(uniqueKey(t), `{}`))
		})
	}
}

func TestMiddlewareStoreServerErrorsReplaysA5xx(t *testing.T) {
	var runs int32
	on := settingsPool(t, map[string]string{"idempotency.store_server_errors": "on"})
	srv := serve(t, on, Options{}, declining(&runs))
	c := keyed(uniqueKey(t), `{}`)
	first := send(t, srv, c)
	if first.status != 502 || string(first.body) != "declined 1" || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %d %v %q", first.status, first.header, first.body)
	}
	if rec, err := Lookup(ctx, pool, aliceScope, c.header["X-Key"]); err != nil || rec == nil ||
		rec.State != "completed" || rec.StatusCode != 502 {
		t.Fatalf("record after the 502: %+v %v", rec, err)
	}
	again := send(t, srv, c)
	if again.status != 502 || !bytes.Equal(again.body, first.body) ||
		again.header.Get("Idempotent-Replayed") != "true" || again.header.Get("Content-Type") != "text/plain" {
		t.Fatalf("retry: %d %v %q", again.status, again.header, again.body)
	}
	if runs != 1 || writesOf(t, c.header["X-Key"]) != 0 {
		t.Fatalf("%d runs, %d writes; want 1 run and its writes rolled back", runs, writesOf(t, c.header["X-Key"]))
	}
}

// A 5xx over idempotency.max_response_bytes cannot be stored (54000): it is
// released instead, and the handler's answer still goes out.
func TestMiddlewareStoreServerErrorsTooLargeIsReleased(t *testing.T) {
	var runs int32
	small := settingsPool(t, map[string]string{"idempotency.store_server_errors": "on",
		"idempotency.max_response_bytes": "8"})
	wantReleasedTwice(t, serve(t, small, Options{}, declining(&runs)), keyed(uniqueKey(t), `{}`))
}

func TestMiddlewarePanicRollsBackAndReleases(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
		if atomic.AddInt32(&runs, 1) == 1 {
			write(r, r.Header.Get("X-Key"))
			panic("handler bug")
		}
		w.WriteHeader(201)
	})
	c := keyed(uniqueKey(t), `{}`)
	req, _ := http.NewRequest(http.MethodPost, srv.URL+c.path, strings.NewReader(c.body))
	req.Header["Idempotency-Key"] = c.keys
	req.Header.Set("X-Key", c.header["X-Key"])
	req.Header.Set("Authorization", "Bearer alice")
	if resp, err := srv.Client().Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("a panicking handler answered %d", resp.StatusCode)
	}
	if n := writesOf(t, c.header["X-Key"]); n != 0 {
		t.Fatalf("%d writes of the panicking handler committed", n)
	}
	if r := send(t, srv, c); r.status != 201 || runs != 2 {
		t.Fatalf("retry after a panic: %d after %d runs", r.status, runs)
	}
}

func TestMiddlewareClaimLost(t *testing.T) {
	if oneTransaction {
		t.Skip("in one transaction, a claim that has not committed cannot be taken over")
	}
	var proceed *gate
	started := make(chan bool, 1)
	srv := serve(t, pool, Options{Lease: 300 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		write(r, r.Header.Get("X-Key"))
		if TicketFrom(r.Context()).Attempt == 1 {
			started <- true
			proceed.wait()
		}
		w.WriteHeader(201)
		fmt.Fprintf(w, "attempt %d", TicketFrom(r.Context()).Attempt)
	})
	proceed = newGate(t)
	key := uniqueKey(t)
	c := keyed(key, `{}`)
	lost := make(chan reply, 1)
	go func() { lost <- send(t, srv, c) }()
	receive(t, started)
	waitLeaseEnded(t, aliceScope, key)
	if r := send(t, srv, c); r.status != 201 || string(r.body) != "attempt 2" {
		t.Fatalf("takeover: %d %q", r.status, r.body)
	}
	proceed.open()
	r := receive(t, lost)
	wantProblem(t, r, 409, CodeClaimLost)
	wantRetryAfter(t, r, 1, 1)
	var attempts []int32
	rows, err := pool.Query(ctx, `SELECT attempt FROM writes WHERE key = $1`, key)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var a int32
		rows.Scan(&a)
		attempts = append(attempts, a)
	}
	if len(attempts) != 1 || attempts[0] != 2 {
		t.Fatalf("writes committed by attempts %v, want [2]", attempts)
	}
	if r := send(t, srv, c); string(r.body) != "attempt 2" || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry after both: %d %q", r.status, r.body)
	}
}

// unreachablePool is a pool on a port where nothing listens.
func unreachablePool(t *testing.T) *pgxpool.Pool {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cfg, err := pgxpool.ParseConfig("postgres://nobody@" + addr + "/none?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// readOnlyPool is a pool on DATABASE_URL whose transactions are read only,
// so that every claim fails (25006) while the database answers.
func readOnlyPool(t *testing.T) *pgxpool.Pool {
	return settingsPool(t, map[string]string{"default_transaction_read_only": "on"})
}

// settingsPool is a pool on DATABASE_URL whose sessions start with these settings.
func settingsPool(t *testing.T, settings map[string]string) *pgxpool.Pool {
	cfg := pool.Config()
	for name, setting := range settings {
		cfg.ConnConfig.RuntimeParams[name] = setting
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func TestMiddlewareDatabaseUnreachable(t *testing.T) {
	var runs int32
	down := unreachablePool(t)
	for _, failOpen := range []bool{false, true} {
		// Fail-open or not, the handler needs the database for its transaction.
		srv := serve(t, down, Options{FailOpen: failOpen}, charge(&runs))
		r := send(t, srv, keyed(uniqueKey(t), `{}`))
		wantProblem(t, r, 503, CodeUnavailable)
		wantRetryAfter(t, r, 1, 1)
	}
	if runs != 0 {
		t.Fatalf("the handler ran %d times", runs)
	}
}

func TestMiddlewareClaimFailing(t *testing.T) {
	var runs int32
	readOnly := readOnlyPool(t)
	srv := serve(t, readOnly, Options{}, func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&runs, 1)
		w.WriteHeader(201)
	})
	c := keyed(uniqueKey(t), `{}`)
	r := send(t, srv, c)
	wantProblem(t, r, 503, CodeUnavailable)
	wantRetryAfter(t, r, 1, 1)
	if runs != 0 {
		t.Fatalf("fail closed: the handler ran")
	}
	srv = serve(t, readOnly, Options{FailOpen: true}, func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&runs, 1)
		w.WriteHeader(201)
	})
	if r := send(t, srv, c); r.status != 201 || runs != 1 {
		t.Fatalf("fail open: %d after %d runs", r.status, runs)
	}
	if rec, err := Lookup(ctx, pool, "", c.header["X-Key"]); rec != nil || err != nil {
		t.Fatalf("fail open left a record: %+v %v", rec, err)
	}
}

// When the response cannot be kept, the writes are not kept either: 503,
// and the key is free for the retry.
func TestMiddlewareUnstoredResponseRollsBack(t *testing.T) {
	failures := map[string]func(w http.ResponseWriter, r *http.Request){
		"COMMIT fails": func(w http.ResponseWriter, r *http.Request) {
			Tx(r.Context()).Exec(r.Context(), `INSERT INTO deferred VALUES ($1), ($1)`, // deferred unique
				r.Header.Get("X-Key"))
			w.WriteHeader(201)
		},
		"complete fails": func(w http.ResponseWriter, r *http.Request) {
			w.Write(make([]byte, 1<<20+1)) // over idempotency.max_response_bytes
		},
	}
	for name, fail := range failures {
		t.Run(name, func(t *testing.T) {
			var runs int32
			srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
				atomic.AddInt32(&runs, 1)
				write(r, r.Header.Get("X-Key"))
				fail(w, r)
			})
			c := keyed(uniqueKey(t), `{}`)
			wantProblem(t, send(t, srv, c), 503, CodeUnavailable)
			if rec, err := Lookup(ctx, pool, aliceScope, c.header["X-Key"]); rec != nil || err != nil {
				t.Fatalf("the key is still held: %+v %v", rec, err)
			}
			if n := writesOf(t, c.header["X-Key"]); n != 0 {
				t.Fatalf("%d writes committed", n)
			}
			if send(t, srv, c); runs != 2 {
				t.Fatalf("the retry did not run: %d runs", runs)
			}
		})
	}
}

func TestMiddlewareRequestBodyTooLarge(t *testing.T) {
	var runs int32
	srv := serve(t, pool, Options{MaxBodyBytes: 10}, charge(&runs))
	wantProblem(t, send(t, srv, keyed(uniqueKey(t), `{"amount":100}`)), 413, CodeBodyTooLarge)
	if r := send(t, srv, keyed(uniqueKey(t), `{"a":1}`)); r.status != 201 || runs != 1 {
		t.Fatalf("a body within the limit: %d", r.status)
	}
}

func TestMiddlewareConcurrentRequestsRunOnce(t *testing.T) {
	const n = 8
	var runs int32
	var others *gate
	srv := serve(t, pool, Options{}, func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&runs, 1)
		others.wait() // hold the key until every other request has its answer
		w.WriteHeader(201)
	})
	others = newGate(t)
	c := keyed(uniqueKey(t), `{}`)
	replies := make(chan reply, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			replies <- send(t, srv, c)
		}()
	}
	statuses := map[int]int{}
	for i := 0; i < n-1; i++ {
		r := receive(t, replies)
		statuses[r.status]++
		if r.status == 409 {
			wantProblem(t, r, 409, CodeKeyInProgress)
		}
	}
	others.open()
	wg.Wait()
	statuses[receive(t, replies).status]++
	if runs != 1 || statuses[201] != 1 || statuses[409] != n-1 {
		t.Fatalf("%d runs, statuses %v; want 1 run, one 201 and %d 409", runs, statuses, n-1)
	}
	if r := send(t, srv, c); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("afterwards: %d %v", r.status, r.header)
	}
}
