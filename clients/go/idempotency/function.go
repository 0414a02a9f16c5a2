package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
)

// Work names a unit of work for Run.
type Work struct {
	Scope string // whose work (an account, a sender, a queue); "" is unscoped
	Key   string // one per unit of work (a job's id, an event's id), 1..255 bytes
	// Args is what the work is done on, fingerprinted (SHA-256 of its
	// canonical JSON): the same Key with other Args is a *MismatchError.
	Args any
}

// RunOptions configure Run; the zero value runs in one transaction.
type RunOptions struct {
	// TwoTransactions commits the claim before fn runs: for work that calls
	// out of the database. The lease is renewed while fn runs, and
	// Checkpoint commits progress that a takeover resumes after.
	TwoTransactions bool
	Lease           time.Duration // 0: idempotency.lease (60s)
	Retention       time.Duration // how long the result is kept; 0: idempotency.retention (24h)
	// Wait is how long a duplicate waits for the run in progress, then
	// returns an *InProgressError; 0: DefaultWait; negative: not at all.
	Wait time.Duration
	// ExtendEvery is how often the lease is renewed (TwoTransactions);
	// 0: a third of the lease.
	ExtendEvery time.Duration
	// Final says which errors of fn are kept: stored, and returned to
	// every duplicate as a *StoredError. nil: none (an error frees the key).
	Final          func(error) bool
	Logger         *log.Logger          // default the log package's
	TracerProvider trace.TracerProvider // the spans of the middleware; nil: the global one
	// Prepare sends Run's statements prepared once per connection, as
	// Options.Prepare does the middleware's.
	Prepare bool
}

// ErrInProgress matches (errors.Is) every *InProgressError.
var ErrInProgress = errors.New("idempotency: the key is in progress")

// InProgressError is a duplicate that arrived while the first run still ran
// (past Wait).
type InProgressError struct {
	Scope, Key string
	RetryAfter int // whole seconds until the lease ends, at least 1
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("idempotency: key %q is in progress; retry in %d s", e.Key, e.RetryAfter)
}

// Is makes errors.Is(err, ErrInProgress) true.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// ErrMismatch matches (errors.Is) every *MismatchError.
var ErrMismatch = errors.New("idempotency: the key was used with other arguments")

// MismatchError is a key reused with other Args (as 422 is over HTTP).
type MismatchError struct{ Scope, Key string }

func (e *MismatchError) Error() string {
	return fmt.Sprintf("idempotency: key %q was used with other arguments", e.Key)
}

// Is makes errors.Is(err, ErrMismatch) true.
func (e *MismatchError) Is(target error) bool { return target == ErrMismatch }

// StoredError is a final error (RunOptions.Final) of the first run, as a
// duplicate gets it back.
type StoredError struct {
	Scope   string `json:"-"`
	Key     string `json:"-"`
	Type    string `json:"type"`    // the Go type of the first run's error
	Message string `json:"message"` // its Error()
}

func (e *StoredError) Error() string { return e.Message }

// The status codes of a stored result and of a stored final error.
const (
	resultStatus  = 200
	failureStatus = 400
)

// Run runs fn once per Work.Key (and Scope), with a transaction whose
// writes commit with fn's result (JSON) stored: a duplicate gets the stored
// result back without running fn; one that arrives while fn runs waits, then
// gets an *InProgressError; the same key with other Args gets a
// *MismatchError. An error of fn rolls its writes back and frees the key,
// unless RunOptions.Final keeps it. fn must not commit or roll back tx.
// TicketFrom(ctx) in fn tells a takeover's attempt and recovery point;
// Checkpoint records one. A COMMIT whose answer was lost is resolved by
// claiming again with the call's token, as the middleware does.
func Run[T any](ctx context.Context, pool Pool, w Work, fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...RunOptions) (T, error) {
	var value, zero T
	f, c, err := newFunction(pgxStore{Pool: pool, prepare: len(opts) > 0 && opts[0].Prepare}, w, opts)
	if err != nil {
		return zero, err
	}
	stored, ran, err := f.call(ctx, c, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		v, err := fn(ctx, tx)
		if err != nil {
			return nil, err
		}
		value = v
		return json.Marshal(v)
	})
	switch {
	case err != nil:
		return zero, err
	case ran:
		return value, nil
	}
	if err := json.Unmarshal(stored, &value); err != nil {
		return zero, fmt.Errorf("idempotency: the stored result of key %q does not decode: %w", w.Key, err)
	}
	return value, nil
}

// function is Run's flow: the middleware's guard (the same claim, complete,
// release, lost answers and spans) without HTTP.
type function struct {
	g     *guard
	opts  RunOptions
	final func(error) bool
}

// work is fn as the flow runs it: its result as JSON.
type work func(ctx context.Context, tx pgx.Tx) ([]byte, error)

// newFunction checks opts and makes the claim of w, on db.
func newFunction(db store, w Work, opts []RunOptions) (*function, *claim, error) {
	if len(opts) > 1 {
		panic("idempotency: Run takes one RunOptions at most")
	}
	var o RunOptions
	if len(opts) == 1 {
		o = opts[0]
	}
	if o.Lease < 0 || o.Retention < 0 || o.ExtendEvery < 0 {
		panic("idempotency: Lease, Retention and ExtendEvery must not be negative")
	}
	fingerprint, err := ArgsFingerprint(w.Args)
	if err != nil {
		return nil, nil, err
	}
	g := newGuard(db, Options{Lease: o.Lease, Retention: o.Retention, OneTransaction: !o.TwoTransactions,
		Logger: o.Logger, TracerProvider: o.TracerProvider})
	switch {
	case o.Wait == 0:
		g.opts.Wait = DefaultWait
	case o.Wait < 0:
		g.opts.Wait = 0
	default:
		g.opts.Wait = o.Wait
	}
	f := &function{g: g, opts: o, final: o.Final}
	if f.final == nil {
		f.final = func(error) bool { return false }
	}
	return f, &claim{params: ClaimParams{Scope: w.Scope, Key: w.Key, Fingerprint: fingerprint,
		Lease: o.Lease, Retention: o.Retention, Wait: g.opts.Wait, Token: NewToken()}}, nil
}

// ArgsFingerprint is Run's fingerprint of args: the SHA-256 of a prefix and
// their canonical JSON (canonical.go), the bytes every client of the project
// makes of the same arguments, so equal arguments, and only those, give the
// same fingerprint.
func ArgsFingerprint(args any) ([]byte, error) {
	canonical, err := canonicalJSON(args)
	if err != nil {
		return nil, fmt.Errorf("idempotency: the arguments have no canonical JSON: %w", err)
	}
	sum := sha256.Sum256(append([]byte("pg-idempotency function\n"), canonical...))
	return sum[:], nil
}

// call runs fn once for claim c: its result as JSON, and whether it ran
// here (ran) or came from the record. When a COMMIT's answer was lost, the
// claim asked again with c's token says what happened: Replay of the same
// result (it committed), or New (it rolled back: fn runs again).
func (f *function) call(ctx context.Context, c *claim, fn work) (result []byte, ran bool, err error) {
	var lost []byte // the result whose COMMIT's answer was lost
	for runs := 1; ; runs++ {
		tx, t, err := f.claim(ctx, c)
		switch {
		case err != nil && lost != nil:
			return nil, false, fmt.Errorf("idempotency: the COMMIT's answer was lost and the database cannot tell "+
				"whether it took effect; call again with the same Work: %w", err)
		case err != nil:
			return nil, false, err
		case t.Outcome != New:
			if lost != nil && t.Outcome == Replay && t.StatusCode == resultStatus && bytes.Equal(t.Body, lost) {
				return lost, true, nil
			}
			return f.answer(t)
		case runs > maxRuns:
			c.ticket = t
			f.g.rollback(tx)
			f.g.free(ctx, c)
			return nil, false, errors.New("idempotency: the COMMIT got no answer, and rolled back, each time; nothing was kept")
		case lost != nil:
			f.g.opts.Logger.Printf("idempotency: the COMMIT got no answer and rolled back; running the function again")
		}
		c.ticket = t
		result, err = f.runOnce(ctx, c, tx, fn)
		if !errors.Is(err, errCommitLost) {
			return result, err == nil, err
		}
		lost = result
	}
}

// claim claims c: in a transaction begun with it (one transaction; a
// transaction is returned only with New), or on its own and then begins fn's.
func (f *function) claim(ctx context.Context, c *claim) (txn, *Ticket, error) {
	g := f.g
	if g.opts.OneTransaction {
		tx, t, askedAgain, err := g.beginClaim(ctx, c.params)
		if err != nil {
			return nil, nil, err
		}
		if t.Outcome != New {
			g.rollback(tx)
		}
		if askedAgain && t.Outcome == InProgress {
			return nil, nil, errors.New("idempotency: the connection was lost while claiming, and the lost claim " +
				"still holds the key; nothing was kept; call again later")
		}
		return tx, t, nil
	}
	t, err := g.claim(ctx, c.params)
	if err != nil || t.Outcome != New {
		return nil, t, err
	}
	tx, err := g.db.begin(ctx)
	if err != nil {
		g.release(ctx, t)
		return nil, nil, err
	}
	return tx, t, nil
}

// answer turns a claim that did not win into Run's answer.
func (f *function) answer(t *Ticket) ([]byte, bool, error) {
	switch t.Outcome {
	case Replay:
		if t.StatusCode != failureStatus {
			return t.Body, false, nil
		}
		e := &StoredError{Scope: t.Scope, Key: t.Key}
		if err := json.Unmarshal(t.Body, e); err != nil {
			e.Message = string(t.Body)
		}
		return nil, false, e
	case InProgress:
		return nil, false, &InProgressError{Scope: t.Scope, Key: t.Key, RetryAfter: max(t.RetryAfter, 1)}
	default: // Mismatch
		return nil, false, &MismatchError{Scope: t.Scope, Key: t.Key}
	}
}

// runOnce runs fn in tx (claim c's), then stores its result with complete
// and commits, or, when fn fails, rolls back and frees the key (or stores
// a final error). errCommitLost (with the result): the COMMIT's answer was lost.
func (f *function) runOnce(ctx context.Context, c *claim, tx txn, fn work) ([]byte, error) {
	stop := f.keepLeased(ctx, c.ticket)
	result, err := f.invoke(ctx, c, tx, fn)
	stop()
	if err != nil {
		f.fail(ctx, c, tx, err)
		return nil, err
	}
	err = f.g.commit(ctx, tx, &completion{ticket: c.ticket, status: resultStatus, body: result})
	switch {
	case err == nil, errors.Is(err, errCommitLost):
		return result, err
	case !errors.Is(err, ErrClaimLost):
		f.g.free(ctx, c)
	}
	return nil, err
}

type runKey struct{}

// running is what Checkpoint finds in fn's context.
type running struct {
	ticket *Ticket
	tx     txn
	twoTx  bool
}

// invoke calls fn with the transaction and the ticket in its context; a
// panic rolls back, frees the key, and goes on.
func (f *function) invoke(ctx context.Context, c *claim, tx txn, fn work) ([]byte, error) {
	defer func() {
		if p := recover(); p != nil {
			f.g.rollback(tx)
			f.g.free(ctx, c)
			panic(p)
		}
	}()
	ctx = context.WithValue(ctx, ticketKey{}, c.ticket)
	ctx = context.WithValue(ctx, runKey{}, &running{ticket: c.ticket, tx: tx, twoTx: f.opts.TwoTransactions})
	return fn(ctx, tx.handle().(pgx.Tx))
}

// fail ends the run of fn that returned err: its writes roll back; the key
// is freed, or, for a final error, the error is stored for duplicates.
func (f *function) fail(ctx context.Context, c *claim, tx txn, err error) {
	f.g.rollback(tx)
	if !f.final(err) {
		f.g.free(ctx, c)
		return
	}
	body, _ := json.Marshal(StoredError{Type: fmt.Sprintf("%T", err), Message: err.Error()})
	f.g.completeApart(ctx, c, &completion{ticket: c.ticket, status: failureStatus, body: body})
}

// keepLeased renews the lease while fn runs (TwoTransactions): every
// ExtendEvery, or a third of the lease. stop ends it.
func (f *function) keepLeased(ctx context.Context, t *Ticket) (stop func()) {
	if !f.opts.TwoTransactions {
		return func() {}
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() {
		defer close(done)
		every, err := f.extendEvery(ctx)
		for err == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
			_, err = t.Extend(ctx, f.g.db, f.opts.Lease)
		}
		if ctx.Err() == nil && !errors.Is(err, ErrClaimLost) { // a lost claim: complete will say so
			f.g.opts.Logger.Printf("idempotency: the lease is no longer renewed: %v", err)
		}
	}()
	return func() { cancel(); <-done }
}

// extendEvery is the time between renewals: ExtendEvery, or a third of the
// lease (the option, else the setting idempotency.lease of the pool's role).
func (f *function) extendEvery(ctx context.Context) (time.Duration, error) {
	if f.opts.ExtendEvery > 0 {
		return f.opts.ExtendEvery, nil
	}
	lease := f.opts.Lease
	if lease == 0 {
		var ms int64
		err := f.g.db.QueryRow(ctx, `SELECT (extract(epoch FROM coalesce(
			pg_catalog.current_setting('idempotency.lease', true)::interval, interval '60 seconds')) * 1000)::bigint`,
			unnamed()...).Scan(&ms)
		if err != nil {
			return 0, err
		}
		lease = time.Duration(ms) * time.Millisecond
	}
	return lease / 3, nil
}

// Checkpoint records a recovery point of the work Run runs (ctx is fn's):
// with TwoTransactions, fn's writes so far commit with it (tx goes on in a
// new transaction) and the lease is renewed; a takeover's TicketFrom(ctx)
// hands point and state back. In one transaction it commits with the rest.
// A *ClaimLostError when the run lost its claim: return it.
func Checkpoint(ctx context.Context, point string, state json.RawMessage) error {
	r, _ := ctx.Value(runKey{}).(*running)
	if r == nil {
		return errors.New("idempotency: Checkpoint is for the function Run runs")
	}
	tx, ok := r.tx.(interface {
		commitWith(ctx context.Context, sql string, args []any) error
	})
	if !r.twoTx || !ok {
		return r.ticket.Checkpoint(ctx, r.tx.handle().(pgx.Tx), point, state)
	}
	if err := tx.commitWith(ctx, checkpointSQL, r.ticket.checkpointArgs(point, state)); err != nil {
		return r.ticket.wrap("checkpoint", err)
	}
	return nil
}
