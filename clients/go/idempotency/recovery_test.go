package idempotency

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
)

// errLost stands for a connection that dropped after the server had answered.
var errLost = errors.New("lossy: the connection dropped before the answer came")

// lossy is a store that loses answers on purpose, as a network does: the
// statement runs to its end on the server, and the middleware gets a
// connection error instead of its answer.
type lossy struct {
	store
	claims    atomic.Int32     // how many claims have run
	loseClaim func(int32) bool // whether to lose the answer of the n-th claim (from 1)
	commits   atomic.Int32     // how many COMMITs to lose yet
	rollBack  bool             // a COMMIT whose answer is lost rolls back instead
}

// QueryRow runs the statement; the answer of a claim that loseClaim picks is lost.
func (l *lossy) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if strings.Contains(sql, "idempotency.claim(") && l.loses() {
		if _, err := l.store.Exec(ctx, sql, args...); err != nil {
			return errRow{err}
		}
		return errRow{errLost}
	}
	return l.store.QueryRow(ctx, sql, args...)
}

// loses counts a claim and tells whether its answer is lost.
func (l *lossy) loses() bool {
	return l.loseClaim != nil && l.loseClaim(l.claims.Add(1))
}

// begin opens a transaction whose COMMIT's answer may be lost.
func (l *lossy) begin(ctx context.Context) (txn, error) {
	tx, err := l.store.begin(ctx)
	if err != nil {
		return nil, err
	}
	return lossyTxn{tx, l}, nil
}

// beginClaim begins and claims; when the claim's answer is lost, so is the
// connection, and the transaction rolls back with it.
func (l *lossy) beginClaim(ctx context.Context, p ClaimParams) (txn, *Ticket, error) {
	tx, t, err := l.store.beginClaim(ctx, p)
	if err != nil || !l.loses() {
		if tx != nil {
			tx = lossyTxn{tx, l}
		}
		return tx, t, err
	}
	tx.rollback(ctx)
	return nil, nil, errLost
}

type lossyTxn struct {
	txn
	l *lossy
}

// finish completes and commits (or, with rollBack, rolls back) and loses
// the answer while l.commits lasts.
func (t lossyTxn) finish(ctx context.Context, c *completion) error {
	if t.l.commits.Add(-1) < 0 {
		return t.txn.finish(ctx, c)
	}
	if t.l.rollBack {
		t.txn.rollback(ctx)
	} else if err := t.txn.finish(ctx, c); err != nil {
		return err
	}
	return errLost
}

// newLossy is a lossy store on the pool: loseClaim picks the claims whose
// answer is lost (nil: none), and the first commits COMMITs lose theirs.
func newLossy(loseClaim func(int32) bool, commits int32, rollBack bool) *lossy {
	return newLossyOn(pgxStore{Pool: pool}, loseClaim, commits, rollBack)
}

// newLossyOn is newLossy on store s.
func newLossyOn(s store, loseClaim func(int32) bool, commits int32, rollBack bool) *lossy {
	l := &lossy{store: s, loseClaim: loseClaim, rollBack: rollBack}
	l.commits.Store(commits)
	return l
}

// firstClaims loses the answers of the first n claims.
func firstClaims(n int32) func(int32) bool { return func(i int32) bool { return i <= n } }

// wantCompletedOnce fails t unless the key's record is completed and the
// handler's writes committed once.
func wantCompletedOnce(t *testing.T, key string) {
	t.Helper()
	rec, err := Lookup(ctx, pool, aliceScope, key)
	if err != nil || rec == nil || rec.State != "completed" || writesOf(t, key) != 1 {
		t.Fatalf("record %+v (%v), %d writes; want completed, 1 write", rec, err, writesOf(t, key))
	}
}

// A claim whose answer was lost is asked again with the request's token: its
// own claim answers New again, not 409, and the handler runs once.
func TestRecoveryClaimAnswerLost(t *testing.T) {
	var runs int32
	l := newLossy(firstClaims(3), 0, false)
	srv := serveGuarded(t, l, Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 201 || runs != 1 || l.claims.Load() != 4 {
		t.Fatalf("%d %s after %d runs, %d claims; want 201 after 1 run, 4 claims", r.status, r.body, runs, l.claims.Load())
	}
	wantCompletedOnce(t, c.header["X-Key"])
}

// The same through MiddlewareSQL: a claim's answer lost, then a COMMIT's
// answer lost that rolled back.
func TestRecoverySQL(t *testing.T) {
	var runs int32
	l := newLossyOn(sqlStore{SQL(sqlDB), sqlDB}, firstClaims(1), 1, true)
	srv := serveGuarded(t, l, Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 201 || !strings.HasPrefix(string(r.body), `{"run":2,`) || runs != 2 {
		t.Fatalf("%d %s after %d runs; want run 2's 201", r.status, r.body, runs)
	}
	wantCompletedOnce(t, c.header["X-Key"])
}

// Every answer lost: 503 after claimTries claims, and the handler did not run.
func TestRecoveryClaimNeverAnswers(t *testing.T) {
	var runs int32
	l := newLossy(func(int32) bool { return true }, 0, false)
	srv := serveGuarded(t, l, Options{}, charge(&runs))
	wantProblem(t, send(t, srv, keyed(uniqueKey(t), `{}`)), 503, CodeUnavailable)
	if runs != 0 || l.claims.Load() != claimTries {
		t.Fatalf("%d runs, %d claims; want 0 and %d", runs, l.claims.Load(), claimTries)
	}
}

// A COMMIT whose answer was lost, that committed: the claim with the token
// answers Replay, and the client gets the handler's answer, not a 503.
func TestRecoveryCommitAnswerLostCommitted(t *testing.T) {
	var runs int32
	srv := serveGuarded(t, newLossy(nil, 1, false),
		Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	r := send(t, srv, c)
	if r.status != 201 || r.header.Get("X-Trace") != "1" || r.header.Get("Idempotent-Replayed") != "" || runs != 1 {
		t.Fatalf("%d %v %s after %d runs; want the handler's own 201 after 1", r.status, r.header, r.body, runs)
	}
	wantCompletedOnce(t, c.header["X-Key"])
}

// A COMMIT whose answer was lost, that rolled back: the claim with the
// token answers New with the same fence, and the handler runs again.
func TestRecoveryCommitAnswerLostRolledBack(t *testing.T) {
	var runs int32
	srv := serveGuarded(t, newLossy(nil, 1, true),
		Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	if r := send(t, srv, c); r.status != 201 || !strings.HasPrefix(string(r.body), `{"run":2,`) || runs != 2 {
		t.Fatalf("%d %s after %d runs; want run 2's 201", r.status, r.body, runs)
	}
	wantCompletedOnce(t, c.header["X-Key"])
}

// Rolled back at every run: maxRuns runs, then 503, the key released.
func TestRecoveryCommitAlwaysRollsBack(t *testing.T) {
	var runs int32
	srv := serveGuarded(t, newLossy(nil, 100, true),
		Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	wantProblem(t, send(t, srv, c), 503, CodeUnavailable)
	rec, err := Lookup(ctx, pool, aliceScope, c.header["X-Key"])
	if runs != maxRuns || rec != nil || err != nil || writesOf(t, c.header["X-Key"]) != 0 {
		t.Fatalf("%d runs, record %+v (%v), %d writes; want %d runs, no record, no write",
			runs, rec, err, writesOf(t, c.header["X-Key"]), maxRuns)
	}
}

// A COMMIT whose answer was lost, when no claim gets an answer either: a
// 503 that does not say nothing ran (it did), and the retry replays.
func TestRecoveryCommitUnknown(t *testing.T) {
	var runs int32
	srv := serveGuarded(t, newLossy(func(n int32) bool { return n > 1 }, 1, false), Options{}, charge(&runs))
	c := keyed(uniqueKey(t), `{}`)
	r := send(t, srv, c)
	wantProblem(t, r, 503, CodeUnavailable)
	if !strings.Contains(string(r.body), "same Idempotency-Key") || strings.Contains(string(r.body), "not carried out") {
		t.Fatalf("the 503 of an unknown outcome says %s", r.body)
	}
	wantCompletedOnce(t, c.header["X-Key"])
	again := send(t, serve(t, pool, Options{}, charge(&runs)), c)
	if again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || runs != 1 {
		t.Fatalf("the retry: %d %v after %d runs", again.status, again.header, runs)
	}
}
