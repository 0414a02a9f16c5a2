package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// receipt is the result of the functions of these tests.
type receipt struct {
	Run    int32  `json:"run"`
	Amount int    `json:"amount"`
	Note   string `json:"note,omitempty"`
}

// order is the Args of these tests.
type order struct {
	Amount int               `json:"amount"`
	Tags   map[string]string `json:"tags,omitempty"`
}

// charging is a function that writes a row for key in its transaction and
// returns a receipt; runs counts its runs.
func charging(key string, amount int, runs *int32) func(context.Context, pgx.Tx) (receipt, error) {
	return func(ctx context.Context, tx pgx.Tx) (receipt, error) {
		n := atomic.AddInt32(runs, 1)
		attempt := 0
		if t := TicketFrom(ctx); t != nil {
			attempt = t.Attempt
		}
		_, err := tx.Exec(ctx, `INSERT INTO writes VALUES ($1, $2)`, key, attempt)
		return receipt{Run: n, Amount: amount}, err
	}
}

// fnModes are Run's two modes.
var fnModes = map[string]RunOptions{"one transaction": {Logger: quiet}, "two transactions": {TwoTransactions: true, Logger: quiet}}

// The first call runs and commits its write with its result; a duplicate
// gets the stored result, deserialized, without running.
func TestRunOnceThenStoredResult(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			w := Work{Scope: "jobs", Key: key, Args: order{Amount: 5}}
			var runs int32
			for i := 0; i < 3; i++ {
				got, err := Run(ctx, pool, w, charging(key, 5, &runs), o)
				if err != nil || got != (receipt{Run: 1, Amount: 5}) {
					t.Fatalf("call %d: %+v %v; want run 1's receipt", i, got, err)
				}
			}
			if runs != 1 || writesOf(t, key) != 1 {
				t.Fatalf("%d runs, %d writes; want 1 and 1", runs, writesOf(t, key))
			}
			rec, err := Lookup(ctx, pool, "jobs", key)
			if err != nil || rec == nil || rec.State != "completed" || rec.StatusCode != resultStatus {
				t.Fatalf("record %+v %v", rec, err)
			}
		})
	}
}

// The fingerprint is that of the arguments' canonical JSON: map order and
// struct or map do not matter, a value does.
func TestArgsFingerprint(t *testing.T) {
	a, _ := ArgsFingerprint(order{Amount: 1, Tags: map[string]string{"b": "2", "a": "1"}})
	b, _ := ArgsFingerprint(map[string]any{"tags": map[string]any{"a": "1", "b": "2"}, "amount": 1})
	c, _ := ArgsFingerprint(order{Amount: 2})
	if string(a) != string(b) || string(a) == string(c) || len(a) != 32 {
		t.Fatalf("fingerprints %x %x %x", a, b, c)
	}
	if _, err := ArgsFingerprint(func() {}); err == nil {
		t.Fatal("a function has a fingerprint")
	}
}

// The same key with other arguments: a *MismatchError, nothing run.
func TestRunMismatch(t *testing.T) {
	key := uniqueKey(t)
	var runs int32
	if _, err := Run(ctx, pool, Work{Key: key, Args: order{Amount: 1}}, charging(key, 1, &runs)); err != nil {
		t.Fatal(err)
	}
	_, err := Run(ctx, pool, Work{Key: key, Args: order{Amount: 2}}, charging(key, 2, &runs))
	var mismatch *MismatchError
	if !errors.As(err, &mismatch) || !errors.Is(err, ErrMismatch) || mismatch.Key != key || runs != 1 {
		t.Fatalf("%v after %d runs; want a *MismatchError after 1", err, runs)
	}
}

// errDeclined is a final error of these tests.
var errDeclined = errors.New("card declined")

// An error rolls the function's writes back and frees the key (the next
// call runs); a final one is stored, and duplicates get it as *StoredError.
func TestRunErrors(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			w := Work{Key: key, Args: order{Amount: 3}}
			var runs int32
			failing := func(fail error) func(context.Context, pgx.Tx) (receipt, error) {
				return func(ctx context.Context, tx pgx.Tx) (receipt, error) {
					r, err := charging(key, 3, &runs)(ctx, tx)
					if err != nil {
						return r, err
					}
					return r, fail
				}
			}
			transient := errors.New("timeout")
			if _, err := Run(ctx, pool, w, failing(transient), o); !errors.Is(err, transient) {
				t.Fatalf("first call: %v", err)
			}
			if rec, err := Lookup(ctx, pool, "", key); rec != nil || err != nil || writesOf(t, key) != 0 {
				t.Fatalf("after an error: record %+v %v, %d writes; want none", rec, err, writesOf(t, key))
			}
			o.Final = func(err error) bool { return errors.Is(err, errDeclined) }
			if _, err := Run(ctx, pool, w, failing(errDeclined), o); !errors.Is(err, errDeclined) {
				t.Fatalf("second call: %v", err)
			}
			_, err := Run(ctx, pool, w, failing(nil), o)
			var stored *StoredError
			if !errors.As(err, &stored) || stored.Message != "card declined" || stored.Key != key || runs != 2 {
				t.Fatalf("duplicate of a final error: %#v after %d runs", err, runs)
			}
			if writesOf(t, key) != 0 {
				t.Fatalf("%d writes of failed runs", writesOf(t, key))
			}
		})
	}
}

// A duplicate that arrives while the first runs waits (Wait), then gets an
// *InProgressError; the first's result is stored after.
func TestRunInProgress(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			w := Work{Key: key, Args: order{Amount: 4}}
			var runs int32
			started, gate := make(chan struct{}), newGate(t)
			first := make(chan error, 1)
			go func() {
				_, err := Run(ctx, pool, w, func(ctx context.Context, tx pgx.Tx) (receipt, error) {
					close(started)
					gate.wait()
					return charging(key, 4, &runs)(ctx, tx)
				}, o)
				first <- err
			}()
			receive(t, started)
			o.Wait = 50 * time.Millisecond
			_, err := Run(ctx, pool, w, charging(key, 4, &runs), o)
			var busy *InProgressError
			if !errors.As(err, &busy) || !errors.Is(err, ErrInProgress) || busy.RetryAfter < 1 {
				t.Fatalf("duplicate: %v; want an *InProgressError", err)
			}
			gate.open()
			if err := receive(t, first); err != nil || runs != 1 || writesOf(t, key) != 1 {
				t.Fatalf("first: %v, %d runs, %d writes", err, runs, writesOf(t, key))
			}
		})
	}
}

// A duplicate arriving while the first runs waits for it (the default
// wait) and gets its stored result.
func TestRunWaitsForTheFirst(t *testing.T) {
	key := uniqueKey(t)
	w := Work{Key: key, Args: order{Amount: 6}}
	var runs int32
	started, gate := make(chan struct{}), newGate(t)
	go Run(ctx, pool, w, func(ctx context.Context, tx pgx.Tx) (receipt, error) {
		close(started)
		gate.wait()
		return charging(key, 6, &runs)(ctx, tx)
	}, RunOptions{TwoTransactions: true})
	receive(t, started)
	second := make(chan receipt, 1)
	go func() {
		r, err := Run(ctx, pool, w, charging(key, 6, &runs), RunOptions{TwoTransactions: true, Wait: 10 * time.Second})
		if err != nil {
			t.Error(err)
		}
		second <- r
	}()
	waitFor(t, func() bool {
		var n int
		pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%idempotency.claim(%'
			AND state = 'active' AND pid <> pg_backend_pid()`).Scan(&n)
		return n == 1
	})
	gate.open()
	if r := receive(t, second); r.Run != 1 || runs != 1 {
		t.Fatalf("the duplicate got %+v after %d runs; want run 1's", r, runs)
	}
}

// With two transactions, the lease is renewed while the function runs: a
// run longer than its lease is not taken over.
func TestRunExtendsTheLease(t *testing.T) {
	key := uniqueKey(t)
	w := Work{Key: key, Args: order{Amount: 7}}
	var runs int32
	o := RunOptions{TwoTransactions: true, Lease: 2 * time.Second, ExtendEvery: 100 * time.Millisecond, Logger: quiet}
	_, err := Run(ctx, pool, w, func(ctx context.Context, tx pgx.Tx) (receipt, error) {
		first, _ := Lookup(ctx, pool, "", key)
		waitFor(t, func() bool {
			now, _ := Lookup(ctx, pool, "", key)
			return now.LeaseExpiresAt.Sub(first.LeaseExpiresAt) > 150*time.Millisecond
		})
		return charging(key, 7, &runs)(ctx, tx)
	}, o)
	if err != nil || runs != 1 {
		t.Fatalf("%v after %d runs", err, runs)
	}
}

// With two transactions, Checkpoint commits the writes so far with a
// recovery point; a takeover after the owner died gets it back (attempt 2)
// and resumes after it.
func TestRunCheckpointAndTakeover(t *testing.T) {
	key := uniqueKey(t)
	w := Work{Key: key, Args: order{Amount: 8}}
	fp, _ := ArgsFingerprint(w.Args)
	// A first owner that checkpoints, then dies (its lease ends).
	dead, err := Claim(ctx, pool, ClaimParams{Key: key, Fingerprint: fp, Lease: time.Second})
	if err != nil || dead.Outcome != New {
		t.Fatal(dead, err)
	}
	if err := dead.Checkpoint(ctx, pool, "charged", json.RawMessage(`{"charge":41}`)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		var ended bool
		pool.QueryRow(ctx, `SELECT lease_expires_at < clock_timestamp() FROM idempotency.lookup($1)`, key).Scan(&ended)
		return ended
	})
	var runs int32
	got, err := Run(ctx, pool, w, func(ctx context.Context, tx pgx.Tx) (receipt, error) {
		ticket := TicketFrom(ctx)
		if ticket.Attempt != 2 || ticket.RecoveryPoint != "charged" || string(ticket.RecoveryState) != `{"charge": 41}` {
			return receipt{}, fmt.Errorf("the takeover's ticket: %+v", ticket)
		}
		r, err := charging(key, 8, &runs)(ctx, tx)
		if err != nil {
			return r, err
		}
		if err := Checkpoint(ctx, "written", nil); err != nil {
			return r, err
		}
		if n := writesOf(t, key); n != 1 { // seen from another connection: committed
			return r, fmt.Errorf("%d writes seen after the checkpoint", n)
		}
		rec, _ := Lookup(ctx, pool, "", key)
		if rec.RecoveryPoint != "written" {
			return r, fmt.Errorf("recovery point %q", rec.RecoveryPoint)
		}
		r.Note = "resumed"
		return r, nil
	}, RunOptions{TwoTransactions: true, Logger: quiet})
	if err != nil || got.Note != "resumed" || runs != 1 {
		t.Fatalf("%+v %v", got, err)
	}
	if _, err := dead.Complete(ctx, pool, 200, nil, nil); !errors.Is(err, ErrClaimLost) {
		t.Fatalf("the dead owner completes: %v", err)
	}
}

// A panic rolls back and frees the key, and goes on.
func TestRunPanic(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			var runs int32
			func() {
				defer func() {
					if recover() == nil {
						t.Fatal("no panic")
					}
				}()
				Run(ctx, pool, Work{Key: key}, func(ctx context.Context, tx pgx.Tx) (receipt, error) {
					charging(key, 1, &runs)(ctx, tx)
					panic("boom")
				}, o)
			}()
			if rec, err := Lookup(ctx, pool, "", key); rec != nil || err != nil || writesOf(t, key) != 0 {
				t.Fatalf("after a panic: %+v %v, %d writes", rec, err, writesOf(t, key))
			}
		})
	}
}

// Lost answers, as in the middleware: a claim's (asked again with the
// token), a COMMIT's that committed (the function's own result, run once),
// a COMMIT's that rolled back (run again).
func TestRunLostAnswers(t *testing.T) {
	cases := []struct {
		name     string
		l        func() *lossy
		wantRuns int32
	}{
		{"claim's answer lost", func() *lossy { return newLossy(firstClaims(2), 0, false) }, 1},
		{"COMMIT's answer lost, committed", func() *lossy { return newLossy(nil, 1, false) }, 1},
		{"COMMIT's answer lost, rolled back", func() *lossy { return newLossy(nil, 1, true) }, 2},
	}
	for name, o := range fnModes {
		for _, c := range cases {
			t.Run(name+": "+c.name, func(t *testing.T) {
				key := uniqueKey(t)
				var runs int32
				f, cl, err := newFunction(c.l(), Work{Key: key, Args: 1}, []RunOptions{o})
				if err != nil {
					t.Fatal(err)
				}
				var value receipt
				_, ran, err := f.call(ctx, cl, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					r, err := charging(key, 1, &runs)(ctx, tx)
					value = r
					b, _ := json.Marshal(r)
					return b, err
				})
				if err != nil || !ran || runs != c.wantRuns || value.Run != c.wantRuns {
					t.Fatalf("%v, ran %v, %d runs; want run %d's own result", err, ran, runs, c.wantRuns)
				}
				rec, _ := Lookup(ctx, pool, "", key)
				if rec == nil || rec.State != "completed" || writesOf(t, key) != 1 {
					t.Fatalf("record %+v, %d writes", rec, writesOf(t, key))
				}
			})
		}
	}
}

// Run adds no round trip over the middleware's in the same mode: one
// transaction, BEGIN+claim, the function's insert, complete+COMMIT (3); two,
// the claim, BEGIN, the insert, complete+COMMIT (4); a duplicate, 2
// (BEGIN+claim, ROLLBACK) and 1.
func TestRunRoundTrips(t *testing.T) {
	want := map[bool][2]int64{false: {4, 1}, true: {3, 2}} // as TestRoundTrips: fresh, replay
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			counted, counter := countedPool(t)
			o.ExtendEvery = time.Hour
			var runs int32
			warm := uniqueKey(t) // connects, and prepares the insert
			Run(ctx, counted, Work{Key: warm}, charging(warm, 1, &runs), o)
			runs = 0
			key := uniqueKey(t)
			w := Work{Key: key, Args: 1}
			before := counter.Count()
			if _, err := Run(ctx, counted, w, charging(key, 1, &runs), o); err != nil {
				t.Fatal(err)
			}
			fresh := counter.Count() - before
			before = counter.Count()
			if _, err := Run(ctx, counted, w, charging(key, 1, &runs), o); err != nil || runs != 1 {
				t.Fatal(err, runs)
			}
			if got := [2]int64{fresh, counter.Count() - before}; got != want[!o.TwoTransactions] {
				t.Fatalf("round trips (fresh, duplicate) %v, want %v", got, want[!o.TwoTransactions])
			}
		})
	}
}

// A COMMIT whose answer is lost and that rolls back every time: maxRuns
// runs, then an error; nothing kept, the key freed.
func TestRunCommitAlwaysRollsBack(t *testing.T) {
	for name, o := range fnModes {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			var runs int32
			f, cl, err := newFunction(newLossy(nil, 100, true), Work{Key: key}, []RunOptions{o})
			if err != nil {
				t.Fatal(err)
			}
			_, _, err = f.call(ctx, cl, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := charging(key, 1, &runs)(ctx, tx)
				return []byte(`{}`), err
			})
			rec, lerr := Lookup(ctx, pool, "", key)
			if err == nil || runs != maxRuns || rec != nil || lerr != nil || writesOf(t, key) != 0 {
				t.Fatalf("%v after %d runs, record %+v %v, %d writes; want an error after %d runs, nothing kept",
					err, runs, rec, lerr, writesOf(t, key), maxRuns)
			}
		})
	}
}
