package idempotency

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency/idempotency/clients/go/internal/roundtrip"
	"github.com/jackc/pgx/v5/pgxpool"
)

// serveMode starts a test server of h behind the middleware on db, in one
// transaction or two, whatever IDEMPOTENCY_ONE_TRANSACTION says.
func serveMode(t *testing.T, db Pool, one bool, opts Options, h http.HandlerFunc) *httptest.Server {
	opts.Logger, opts.OneTransaction = quiet, one
	srv := httptest.NewUnstartedServer(newGuard(pgxStore{Pool: db}, opts).middleware(h))
	srv.Config.ErrorLog = quiet
	srv.Start()
	srv.Client().Timeout = 20 * time.Second
	t.Cleanup(srv.Close)
	return srv
}

// waitIdle waits until no connection of db is in use.
func waitIdle(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); db.Stat().AcquiredConns() > 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a connection is still in use")
		}
	}
}

// gatedStore is a store whose transactions roll back once gate opens.
type gatedStore struct {
	store
	gate *gate
}

func (s *gatedStore) beginClaim(ctx context.Context, p ClaimParams) (txn, *Ticket, error) {
	tx, t, err := s.store.beginClaim(ctx, p)
	if tx != nil {
		tx = gatedTxn{tx, s.gate}
	}
	return tx, t, err
}

type gatedTxn struct {
	txn
	gate *gate
}

func (t gatedTxn) rollback(ctx context.Context) error {
	t.gate.wait()
	return t.txn.rollback(ctx)
}

// In one transaction, a replay, a mismatch and a 409 are answered before
// their transaction, which only read, has rolled back: one round trip
// before the reply, as in two.
func TestOneTransactionAnswersBeforeRollback(t *testing.T) {
	var runs int32
	gated := &gatedStore{store: pgxStore{Pool: pool}}
	srv := serveGuarded(t, gated, Options{OneTransaction: true}, charge(&runs))
	gated.gate = newGate(t) // after the server: its cleanup opens the gate first
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 201 {
		t.Fatalf("fresh: %d %s", r.status, r.body)
	}
	other := c
	other.body = `{"other":1}`
	for _, want := range []struct {
		c      call
		status int
	}{{c, 201}, {other, 422}} {
		replied := make(chan reply, 1)
		go func() { replied <- send(t, srv, want.c) }()
		if r := receive(t, replied); r.status != want.status {
			t.Fatalf("%d %s; want %d", r.status, r.body, want.status)
		}
	}
}

// modes names the two forms of the middleware.
var modes = map[string]bool{"two transactions": false, "one transaction": true}

// A claim with a wait, while another transaction's claim of the key has not
// committed: in_progress once the wait is over (the record has no
// created_at yet), not an error.
func TestClaimWaitsForAnUncommittedClaim(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("1")}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if first, err := Claim(ctx, tx, p); err != nil || first.Outcome != New {
		t.Fatalf("first claim: %+v %v", first, err)
	}
	p.Wait = 100 * time.Millisecond
	second, err := Claim(ctx, pool, p)
	if err != nil || second.Outcome != InProgress || second.RetryAfter != 1 || !second.CreatedAt.IsZero() {
		t.Fatalf("second claim: %+v %v; want in_progress, Retry-After 1", second, err)
	}
}

// countedPool is a pool of one connection whose round trips counter counts.
func countedPool(t *testing.T) (*pgxpool.Pool, *roundtrip.Counter) {
	counter := &roundtrip.Counter{}
	cfg := pool.Config()
	counter.Dial(cfg)
	cfg.MaxConns = 1
	counted, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(counted.Close)
	return counted, counter
}

// The database round trips of a fresh request and of a replay: BEGIN
// travels with the claim (one transaction), complete with COMMIT (both).
func TestRoundTrips(t *testing.T) {
	want := map[bool][2]int64{false: {4, 1}, true: {3, 2}} // fresh, replay
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			counted, counter := countedPool(t)
			var runs int32
			srv := serveMode(t, counted, one, Options{}, charge(&runs))
			send(t, srv, keyed(uniqueKey(t), `{}`)) // connects
			for i, c := range []call{keyed(uniqueKey(t), `{}`)} {
				before := counter.Count()
				if r := send(t, srv, c); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
					t.Fatalf("fresh %d: %d", i, r.status)
				}
				fresh := counter.Count() - before
				before = counter.Count()
				if r := send(t, srv, c); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
					t.Fatalf("replay %d: %d", i, r.status)
				}
				waitIdle(t, counted) // one transaction: the replay's ROLLBACK may follow its answer
				if got := [2]int64{fresh, counter.Count() - before}; got != want[one] {
					t.Fatalf("round trips (fresh, replay) %v, want %v", got, want[one])
				}
			}
		})
	}
}

// A process that dies after its handler wrote (its connection closes, no
// COMMIT): in one transaction the claim goes with the writes, and the retry
// runs at once; in two, the claim committed and the retry gets 409 until
// its lease ends.
func TestOneTransactionCrashKeepsNothing(t *testing.T) {
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			var runs int32
			var dead *gate
			crashed := make(chan bool, 1)
			srv := serveMode(t, pool, one, Options{Lease: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
				write(r, r.Header.Get("X-Key"))
				if atomic.AddInt32(&runs, 1) == 1 {
					Tx(r.Context()).Conn().Close(r.Context()) // the process is gone
					crashed <- true
					dead.wait()
				}
				w.WriteHeader(201)
			})
			dead = newGate(t)
			c := keyed(uniqueKey(t), `{}`)
			go send(t, srv, c)
			receive(t, crashed)
			retry := send(t, srv, c)
			if one && (retry.status != 201 || writesOf(t, c.header["X-Key"]) != 1) {
				t.Fatalf("the retry after a crash: %d %s, %d writes; want 201, 1 write", retry.status,
					retry.body, writesOf(t, c.header["X-Key"]))
			}
			if !one {
				wantProblem(t, retry, 409, CodeKeyInProgress)
			}
		})
	}
}

// In one transaction, a duplicate that arrives while the first runs waits
// for it (Wait) and answers from what committed: the replay.
func TestOneTransactionDuplicateWaitsForTheFirst(t *testing.T) {
	var runs int32
	var proceed *gate
	started := make(chan bool, 1)
	srv := serveMode(t, pool, true, Options{Wait: 15 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&runs, 1)
		started <- true
		proceed.wait()
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(201)
		w.Write([]byte("charged"))
	})
	proceed = newGate(t)
	c := keyed(uniqueKey(t), `{}`)
	first := make(chan reply, 1)
	go func() { first <- send(t, srv, c) }()
	receive(t, started)
	second := make(chan reply, 1)
	go func() { second <- send(t, srv, c) }()
	waitForWaitingClaim(t)
	proceed.open()
	one, two := receive(t, first), receive(t, second)
	if one.status != 201 || two.status != 201 || string(two.body) != "charged" ||
		two.header.Get("Idempotent-Replayed") != "true" || runs != 1 {
		t.Fatalf("first %d, second %d %v %q after %d runs; want the second to replay the first", one.status,
			two.status, two.header, two.body, runs)
	}
}

// waitForWaitingClaim returns once a claim waits in another session.
func waitForWaitingClaim(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE state = 'active' AND wait_event IS NOT NULL AND query LIKE '%idempotency.claim(%'
			  AND pid <> pg_backend_pid()`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
	}
	t.Fatal("no claim waited")
}
