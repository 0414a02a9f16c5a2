package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
)

// Pool is what the middleware needs of a connection pool; *pgxpool.Pool is one.
type Pool interface {
	Querier
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// Options configure Middleware; the zero value follows docs/http-contract.md.
type Options struct {
	Methods      []string                   // the methods that take a key; default POST and PATCH
	KeyOptional  bool                       // run a request without a key unguarded instead of answering 400
	FailOpen     bool                       // run the handler unguarded instead of answering 503 when a claim fails
	Lease        time.Duration              // longer than the slowest handler; 0: idempotency.lease (60s)
	Retention    time.Duration              // how long answers are replayed; 0: idempotency.retention (24h)
	StoreHeaders []string                   // the response headers a replay repeats; default Content-Type, Location (Content-Encoding always)
	MaxBodyBytes int64                      // the largest request body read; default 1 MiB
	Scope        func(*http.Request) string // whose keys; default CredentialScope
	Logger       *log.Logger                // where database errors are logged; default the log package's
	// OneTransaction claims in the handler's transaction: the claim, the
	// handler's writes and complete commit together or not at all. Only for
	// handlers whose every effect is in this database (see the README).
	OneTransaction bool
	// Wait is how long a claim waits for a request with the same key that
	// is still running, then answers 409; 0: at once with two transactions,
	// DefaultWait with OneTransaction.
	Wait time.Duration
	// TracerProvider gets the spans idempotency.claim, idempotency.complete
	// and idempotency.release (see the README); nil: the global one
	// (otel.GetTracerProvider), a no-op until the app installs an SDK.
	TracerProvider trace.TracerProvider
	// Key reads the key from where a sender puts it, after verifying the
	// request (body: the request body, nil when empty): a webhook's
	// (StandardWebhook, BodyKey). An error is answered 401
	// webhook_unverified, and nothing is claimed. nil: the Idempotency-Key
	// header.
	Key func(r *http.Request, body []byte) (string, error)
	// Redact is given the response to store (status, the headers a replay
	// repeats, body) and returns the headers and body to store instead; the
	// response sent to this client is unchanged, a replay sends what was
	// stored. A panic is answered 500 idempotency_redact_failed: nothing is
	// stored, the handler's writes roll back, the key is free. nil: stored
	// as sent.
	Redact func(status int, header http.Header, body []byte) (http.Header, []byte)
	// Prepare sends the middleware's statements (claim, complete, release)
	// as statements prepared once per connection, so that the server parses
	// and plans them once, not on every call. Behind a transaction pooler
	// it needs one that keeps them (pgbouncer 1.21 or later with
	// max_prepared_statements). false: unnamed, through any pooler.
	// MiddlewareSQL sends them unnamed either way.
	Prepare bool
}

// DefaultWait is how long, with OneTransaction, a request waits for a
// running one with the same key (whose claim has not committed yet) before
// answering 409.
const DefaultWait = 2 * time.Second

// finishTimeout bounds complete, commit, rollback and release, which run
// even when the client has gone away: the handler's work is kept or undone.
const finishTimeout = 30 * time.Second

// finishing is the context of complete, commit and release: the values of
// ctx (its span, for one) without its end, and finishTimeout.
func finishing(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
}

type txKey struct{}
type ticketKey struct{}

// Tx returns the transaction that the middleware opened for the handler of
// this request: write through it, and do not commit or roll it back. Nil for
// a request the middleware does not cover.
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

// SQLTx is Tx for MiddlewareSQL: the request's *sql.Tx.
func SQLTx(ctx context.Context) *sql.Tx {
	tx, _ := ctx.Value(txKey{}).(*sql.Tx)
	return tx
}

// TicketFrom returns the request's claim (outcome New): its Attempt and
// recovery point tell a handler whether it resumes a takeover. Nil when the
// request runs unguarded.
func TicketFrom(ctx context.Context) *Ticket {
	t, _ := ctx.Value(ticketKey{}).(*Ticket)
	return t
}

// CredentialScope is the default scope: the lowercase hex SHA-256 of
// "authorization:<Authorization>", else of "x-api-key:<X-API-Key>", else "".
// The credential itself is never stored.
func CredentialScope(r *http.Request) string {
	for _, name := range []string{"Authorization", "X-API-Key"} {
		if values := r.Header.Values(name); len(values) > 0 {
			sum := sha256.Sum256([]byte(strings.ToLower(name) + ":" + values[0]))
			return hex.EncodeToString(sum[:])
		}
	}
	return ""
}

// guard is the middleware's configuration, defaults applied.
type guard struct {
	db      store
	opts    Options
	methods map[string]bool
	stored  []string // canonical names of the headers to store
	tracer  trace.Tracer
}

// Middleware returns net/http middleware that makes the covered requests
// safe to retry: it claims the request's Idempotency-Key, answers retries
// from the stored response, and runs a new request's handler in a
// transaction (Tx) that commits with the stored response. It panics on a
// negative Lease, Retention or MaxBodyBytes.
func Middleware(pool Pool, opts Options) func(http.Handler) http.Handler {
	return newGuard(pgxStore{Pool: pool, prepare: opts.Prepare}, opts).middleware
}

// MiddlewareSQL is Middleware on database/sql: db is opened with pgx's
// stdlib driver (sql.Open("pgx", url)), and the handler's transaction is
// SQLTx.
func MiddlewareSQL(db *sql.DB, opts Options) func(http.Handler) http.Handler {
	return newGuard(sqlStore{SQL(db), db}, opts).middleware
}

// middleware puts the guard in front of next.
func (g *guard) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.serve(w, r, next)
	})
}

// newGuard checks opts and fills in the defaults.
func newGuard(db store, opts Options) *guard {
	if opts.Lease < 0 || opts.Retention < 0 || opts.MaxBodyBytes < 0 || opts.Wait < 0 {
		panic("idempotency: Lease, Retention, MaxBodyBytes and Wait must not be negative")
	}
	if opts.Wait == 0 && opts.OneTransaction {
		opts.Wait = DefaultWait
	}
	if opts.Methods == nil {
		opts.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if opts.StoreHeaders == nil {
		opts.StoreHeaders = []string{"Content-Type", "Location"}
	}
	if opts.MaxBodyBytes == 0 {
		opts.MaxBodyBytes = 1 << 20
	}
	if opts.Scope == nil {
		opts.Scope = CredentialScope
	}
	if opts.Logger == nil {
		opts.Logger = log.Default()
	}
	g := &guard{db: db, opts: opts, methods: map[string]bool{}, tracer: tracerOf(opts.TracerProvider)}
	for _, m := range opts.Methods {
		g.methods[strings.ToUpper(m)] = true
	}
	for _, name := range opts.StoreHeaders {
		g.stored = append(g.stored, http.CanonicalHeaderKey(name))
	}
	// The stored body as sent: a compression layer inside this one leaves it
	// unreadable without its Content-Encoding, which is therefore always kept.
	if !slices.Contains(g.stored, "Content-Encoding") {
		g.stored = append(g.stored, "Content-Encoding")
	}
	return g
}

// serve claims the key of a covered request and answers, or runs next.
func (g *guard) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if !g.methods[r.Method] {
		next.ServeHTTP(w, r)
		return
	}
	key, body, ok := g.keyAndBody(w, r, next)
	if !ok {
		return
	}
	path, query := pathAndQuery(r)
	c := &claim{body: body, params: ClaimParams{
		Scope: g.opts.Scope(r), Key: key, Fingerprint: Fingerprint(r.Method, path, body, query),
		Lease: g.opts.Lease, Retention: g.opts.Retention, Wait: g.opts.Wait, Token: NewToken(),
	}}
	if g.opts.OneTransaction {
		g.runClaimed(w, r, next, c)
		return
	}
	t, err := g.claim(r.Context(), c.params)
	switch {
	case err != nil:
		g.claimFailed(w, r, next, err)
	case t.Outcome == New:
		c.ticket = t
		g.run(w, r, next, c)
	default:
		answer(w, t)
	}
}

// keyAndBody reads the request's key and body, or answers (ok false): 400
// without a valid key (or runs next unguarded with KeyOptional), 401 when
// Options.Key does not verify the request, 400 when it finds no key in a
// verified one.
func (g *guard) keyAndBody(w http.ResponseWriter, r *http.Request, next http.Handler) (key string, body []byte, ok bool) {
	var err error
	if g.opts.Key == nil {
		key, err = ParseKey(r.Header.Values("Idempotency-Key"))
	}
	switch {
	case err == errKeyMissing && g.opts.KeyOptional:
		g.run(w, r, next, nil)
		return "", nil, false
	case err == errKeyMissing:
		writeProblem(w, http.StatusBadRequest, CodeKeyMissing, err.Error(), 0)
		return "", nil, false
	case err != nil:
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, err.Error(), 0)
		return "", nil, false
	}
	if body, ok = g.readBody(w, r); !ok || g.opts.Key == nil {
		return key, body, ok
	}
	var noKey *noKeyError
	key, err = g.opts.Key(r, body)
	switch {
	case errors.As(err, &noKey):
		writeProblem(w, http.StatusBadRequest, CodeKeyMissing, err.Error(), 0)
	case err != nil:
		writeProblem(w, http.StatusUnauthorized, CodeWebhookUnverified, err.Error(), 0)
	default:
		return key, body, true
	}
	return "", nil, false
}

// claimFailed answers a request whose claim failed: 400 for a key the
// extension refused, else 503, or with FailOpen the handler runs unguarded.
func (g *guard) claimFailed(w http.ResponseWriter, r *http.Request, next http.Handler, err error) {
	switch {
	case SQLState(err) == codeInvalidArg:
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid,
			"the idempotency store refused this Idempotency-Key", 0)
	case g.opts.FailOpen:
		g.opts.Logger.Printf("idempotency: running unguarded: %v", err)
		g.run(w, r, next, nil)
	default:
		g.unavailable(w, err)
	}
}

// claim is a covered request's claim: what was asked (with the request's
// token) and the body to run its handler on again.
type claim struct {
	params ClaimParams
	body   []byte
	ticket *Ticket // outcome New
}

// How often a claim whose answer was lost is asked, and how long to wait
// before asking again (doubled each time).
const (
	claimTries   = 4
	claimBackoff = 50 * time.Millisecond
)

// claim claims p, asking again with the same token when the answer was lost
// (an error without a server's SQLSTATE: the connection dropped, or could
// not be made). The token makes a claim that did commit answer New again
// with the same fence; the pool hands the retry another connection, since
// pgx closes one that failed.
func (g *guard) claim(ctx context.Context, p ClaimParams) (t *Ticket, err error) {
	err = g.retryLost(ctx, func() error {
		t, err = inSpan(ctx, g.tracer, "claim", p.Key, func(ctx context.Context) (*Ticket, error) {
			return claimOn(ctx, g.db, p)
		}, claimOutcome)
		return err
	})
	return t, err
}

// beginClaim is claim in a new transaction (OneTransaction): BEGIN and the
// claim, asked again the same way; a transaction whose answer was lost
// ended with its connection, or ends when the server learns it is gone.
// askedAgain: an earlier try's answer was lost.
func (g *guard) beginClaim(ctx context.Context, p ClaimParams) (tx txn, t *Ticket, askedAgain bool, err error) {
	tries := 0
	err = g.retryLost(ctx, func() error {
		tries++
		t, err = inSpan(ctx, g.tracer, "claim", p.Key, func(ctx context.Context) (t *Ticket, err error) {
			tx, t, err = g.db.beginClaim(ctx, p)
			return t, err
		}, claimOutcome)
		return err
	})
	return tx, t, tries > 1, err
}

// retryLost runs ask until it gets an answer (an error with a server's
// SQLSTATE is one), claimTries times at most.
func (g *guard) retryLost(ctx context.Context, ask func() error) error {
	wait := claimBackoff
	for try := 1; ; try++ {
		err := ask()
		if err == nil || SQLState(err) != "" || try == claimTries || ctx.Err() != nil {
			return err
		}
		g.opts.Logger.Printf("idempotency: claim %d of %d got no answer, asking again: %v", try, claimTries, err)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return err
		}
		wait *= 2
	}
}

// readBody reads the request body (for the fingerprint) and puts it back
// for the handler; nil when there is none. False when it answered instead.
func (g *guard) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	if r.Body == nil {
		return nil, true
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, g.opts.MaxBodyBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		writeProblem(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge,
			fmt.Sprintf("the request body is over %d bytes", g.opts.MaxBodyBytes), 0)
		return nil, false
	case err != nil:
		writeProblem(w, http.StatusBadRequest, CodeBodyUnread, "the request body could not be read", 0)
		return nil, false
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	if len(body) == 0 {
		return nil, true
	}
	return body, true
}

// pathAndQuery splits the request target as the client sent it: the path,
// and the query (nil when there is no '?' or nothing after it).
func pathAndQuery(r *http.Request) (string, *string) {
	path, query := r.URL.EscapedPath(), r.URL.RawQuery
	if strings.HasPrefix(r.RequestURI, "/") {
		path, query, _ = strings.Cut(r.RequestURI, "?")
	}
	if query == "" {
		return path, nil
	}
	return path, &query
}

// answer replies to a claim that did not win: replay, in progress or mismatch.
func answer(w http.ResponseWriter, t *Ticket) {
	switch t.Outcome {
	case Replay:
		replay(w, t)
	case InProgress:
		writeProblem(w, http.StatusConflict, CodeKeyInProgress,
			"a request with this Idempotency-Key is still in progress; retry after Retry-After seconds",
			max(t.RetryAfter, 1))
	default: // Mismatch
		writeProblem(w, http.StatusUnprocessableEntity, CodeKeyMismatch,
			"this Idempotency-Key was used with a different request", 0)
	}
}

// How many times a request's handler may run when each COMMIT's answer is
// lost and each turns out to have rolled back.
const maxRuns = 3

// run runs next in a transaction that it gives the handler through the
// request context, holding the response until the transaction has ended.
// c is the request's claim, nil when it runs unguarded. When the COMMIT's
// answer is lost, claiming again with the request's token tells what
// happened: Replay (it committed: send the stored response) or New (it
// rolled back: run the handler again).
func (g *guard) run(w http.ResponseWriter, r *http.Request, next http.Handler, c *claim) {
	for runs := 1; ; runs++ {
		rec, lost := g.runOnce(w, r, next, c)
		if !lost {
			return
		}
		if c == nil {
			g.unknown(w, errors.New("the COMMIT of an unguarded request got no answer"))
			return
		}
		ctx, cancel := finishing(r.Context())
		t, err := g.claim(ctx, c.params)
		cancel()
		switch {
		case err != nil:
			g.unknown(w, err)
			return
		case t.Outcome != New:
			answerAfterLoss(w, t, rec)
			return
		case runs == maxRuns:
			g.release(r.Context(), t)
			g.unavailable(w, errors.New("the COMMIT got no answer, and rolled back, each time"))
			return
		}
		g.opts.Logger.Printf("idempotency: the COMMIT got no answer and rolled back; running the handler again")
		c.ticket = t
	}
}

// answerAfterLoss answers a request whose COMMIT's answer was lost from
// the claim that asked again (not New): a Replay of the handler's own
// answer (rec) is that answer, whole (the COMMIT went through); anything
// else is a takeover's answer, or its 409 while it runs.
func answerAfterLoss(w http.ResponseWriter, t *Ticket, rec *recorder) {
	if t.Outcome == Replay && rec != nil && rec.stored != nil && t.StatusCode == rec.status && bytes.Equal(t.Body, rec.stored.body) {
		rec.sendTo(w)
		return
	}
	answer(w, t)
}

// runClaimed is run with OneTransaction: each run begins a transaction
// with the claim in it (one round trip), and the handler runs in it when
// the claim answers New. A COMMIT whose answer was lost is resolved by the
// next run's claim, with the request's token: Replay when it committed, New
// (and the handler runs again) when it rolled back.
func (g *guard) runClaimed(w http.ResponseWriter, r *http.Request, next http.Handler, c *claim) {
	var rec *recorder // the handler's answer whose COMMIT got no answer
	for runs := 1; ; runs++ {
		ctx, cancel := r.Context(), context.CancelFunc(func() {})
		if rec != nil { // the handler's work may have committed: ask whatever the client does
			ctx, cancel = finishing(ctx)
		}
		tx, t, askedAgain, err := g.beginClaim(ctx, c.params)
		cancel()
		switch {
		case err == nil && askedAgain && t.Outcome == InProgress:
			g.rollback(tx)
			g.heldByLostClaim(w, t)
			return
		case err != nil && rec != nil:
			g.unknown(w, err)
			return
		case err != nil:
			g.claimFailed(w, r, next, err)
			return
		case t.Outcome != New:
			// The transaction only read what had committed: answer, and end
			// it meanwhile, a round trip less before the reply.
			go g.rollback(tx)
			answerAfterLoss(w, t, rec)
			return
		case runs > maxRuns:
			g.rollback(tx) // the claim with it: nothing is kept
			g.unavailable(w, errors.New("the COMMIT got no answer, and rolled back, each time"))
			return
		case rec != nil:
			g.opts.Logger.Printf("idempotency: the COMMIT got no answer and rolled back; running the handler again")
		}
		c.ticket = t
		var lost bool
		if rec, lost = g.runIn(w, r, next, tx, c); !lost {
			return
		}
	}
}

// runOnce runs the handler once in a transaction of its own and ends that
// transaction. It answers w, unless the COMMIT's answer was lost (lost):
// then nothing is sent, and rec is what the handler answered.
func (g *guard) runOnce(w http.ResponseWriter, r *http.Request, next http.Handler, c *claim) (rec *recorder, lost bool) {
	tx, err := g.db.begin(r.Context())
	if err != nil {
		g.free(r.Context(), c)
		g.unavailable(w, err)
		return nil, false
	}
	return g.runIn(w, r, next, tx, c)
}

// runIn runs the handler in tx, then ends tx (settle).
func (g *guard) runIn(w http.ResponseWriter, r *http.Request, next http.Handler, tx txn, c *claim) (rec *recorder, lost bool) {
	var t *Ticket
	if c != nil {
		t = c.ticket
		r.Body = io.NopCloser(bytes.NewReader(c.body)) // the handler may run again
	}
	defer func() {
		if p := recover(); p != nil {
			g.rollback(tx)
			g.free(r.Context(), c)
			panic(p)
		}
	}()
	ctx := context.WithValue(context.WithValue(r.Context(), txKey{}, tx.handle()), ticketKey{}, t)
	rec = newRecorder()
	next.ServeHTTP(rec, r.WithContext(ctx))
	rec.finish()
	return rec, g.settle(w, r, tx, c, rec)
}

// settle ends the handler's transaction and sends the response: a 5xx rolls
// back and is abandoned; otherwise complete and commit, or, when that fails,
// 409 (the claim was lost) or 503. A response the handler did not produce by
// finishing (the request's context ended: the client went away, or a
// timeout outside the middleware answered) rolls back and is never stored.
// True, sending nothing, when the COMMIT's answer was lost.
func (g *guard) settle(w http.ResponseWriter, r *http.Request, tx txn, c *claim, rec *recorder) (lost bool) {
	if r.Context().Err() != nil {
		g.rollback(tx)
		g.free(r.Context(), c)
		g.opts.Logger.Printf("idempotency: the request ended before its handler did; its work was undone")
		writeProblem(w, http.StatusServiceUnavailable, CodeUnavailable,
			"the request ended before its handler finished; nothing of it was kept", 1)
		return false
	}
	if rec.status >= 500 {
		g.abandon(r.Context(), tx, c, rec)
		rec.sendTo(w)
		return false
	}
	var done *completion
	if c != nil {
		var err error
		if done, err = g.completion(c.ticket, rec); err != nil {
			g.rollback(tx)
			g.free(r.Context(), c)
			g.opts.Logger.Printf("idempotency: %v; nothing was stored, the key is free", err)
			writeProblem(w, http.StatusInternalServerError, CodeRedactFailed,
				"the response could not be redacted for storing; nothing of it was kept", 0)
			return false
		}
	}
	err := g.commit(r.Context(), tx, done)
	switch {
	case err == nil:
		rec.sendTo(w)
	case errors.Is(err, ErrClaimLost):
		writeProblem(w, http.StatusConflict, CodeClaimLost,
			"this request ran past its lease and a retry took it over; its work was undone", 1)
	case errors.Is(err, errCommitLost):
		return true
	default:
		g.free(r.Context(), c)
		g.unavailable(w, err)
	}
	return false
}

// errCommitLost wraps a COMMIT's error that came with no answer from the
// server: whether the transaction committed is not known.
var errCommitLost = errors.New("the COMMIT got no answer")

// completion is what complete stores of rec for ticket t: the headers a
// replay repeats, redacted (Options.Redact); kept on rec as rec.stored. An
// error when Redact panicked: nothing is to be stored.
func (g *guard) completion(t *Ticket, rec *recorder) (*completion, error) {
	header, body := g.storedHeader(rec), rec.body.Bytes()
	if g.opts.Redact != nil {
		var err error
		if header, body, err = g.redact(rec.status, header, bytes.Clone(body)); err != nil {
			return nil, err
		}
	}
	rec.stored = &completion{ticket: t, status: rec.status, body: body, header: header}
	return rec.stored, nil
}

// redact runs Options.Redact, its panic made an error.
func (g *guard) redact(status int, header http.Header, body []byte) (_ http.Header, _ []byte, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("the Redact option panicked: %v", p)
		}
	}()
	header, body = g.opts.Redact(status, header, body)
	return header, body, nil
}

// commit stores the response with complete (done, unless nil: unguarded)
// and commits (on pgx in one round trip). A failed complete rolls back
// (nothing committed, whatever the error); a failure without an answer
// from the server is errCommitLost: whether it committed is not known.
func (g *guard) commit(ctx context.Context, tx txn, done *completion) error {
	ctx, cancel := finishing(ctx)
	defer cancel()
	var err error
	if done == nil {
		err = tx.finish(ctx, nil)
	} else {
		_, err = inSpan(ctx, g.tracer, "complete", done.ticket.Key, func(ctx context.Context) (*completion, error) {
			return done, tx.finish(ctx, done)
		}, func(c *completion) (string, int) { return c.result, 0 })
	}
	if err == nil {
		return nil
	}
	tx.rollback(ctx)
	if SQLState(err) == "" && !errors.Is(err, pgx.ErrTxCommitRollback) {
		return fmt.Errorf("%w: %w", errCommitLost, err)
	}
	return err
}

// storedHeader picks the headers of rec that a replay repeats.
func (g *guard) storedHeader(rec *recorder) http.Header {
	stored := http.Header{}
	for _, name := range g.stored {
		if values := rec.header.Values(name); len(values) > 0 {
			stored[name] = values
		}
	}
	return stored
}

// abandon rolls back the transaction of a handler that answered 5xx, then
// hands its response to complete, which frees the key (or, with
// idempotency.store_server_errors on, stores the response for replay). A
// 5xx the handler did not produce by finishing (http.TimeoutHandler's,
// inside the middleware: a context it used on the transaction ran out) is
// never stored: the key is freed.
func (g *guard) abandon(ctx context.Context, tx txn, c *claim, rec *recorder) {
	cut := tx.cut()
	g.rollback(tx)
	if c == nil {
		return
	}
	if cut {
		g.free(ctx, c)
		return
	}
	done, err := g.completion(c.ticket, rec)
	if err != nil {
		g.free(ctx, c) // nothing stored: the retry runs again
		return
	}
	g.completeApart(ctx, c, done)
}

// completeApart runs complete for claim c on its own, after the work's
// transaction rolled back (a 5xx, a function's final error). With
// OneTransaction the claim rolled back too: it is made again, on its own,
// for complete. When complete fails otherwise than by IK001 (54000: too
// large to store, among others), release frees the key.
func (g *guard) completeApart(ctx context.Context, c *claim, done *completion) {
	ctx, cancel := finishing(ctx)
	defer cancel()
	t := c.ticket
	if g.opts.OneTransaction {
		var err error
		if t, err = g.claim(ctx, c.params); err != nil || t.Outcome != New {
			return // nothing of ours is held
		}
	}
	_, err := inSpan(ctx, g.tracer, "complete", t.Key, func(ctx context.Context) (string, error) {
		return t.complete(ctx, g.db, done.status, done.body, done.header)
	}, completeOutcome)
	if err == nil || errors.Is(err, ErrClaimLost) {
		return // ended, or a retry owns the key: nothing of ours to free
	}
	g.opts.Logger.Printf("idempotency: could not end the claim after a %d: %v", done.status, err)
	g.release(ctx, t)
}

// free frees the key of claim c so that a retry runs again; with
// OneTransaction the rollback did (the claim was in the transaction).
func (g *guard) free(ctx context.Context, c *claim) {
	if c != nil && !g.opts.OneTransaction {
		g.release(ctx, c.ticket)
	}
}

// rollback undoes the handler's transaction.
func (g *guard) rollback(tx txn) {
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	if err := tx.rollback(ctx); err != nil {
		g.opts.Logger.Printf("idempotency: rollback: %v", err)
	}
}

// release frees the key of claim t (if any) so that a retry runs again; a
// failure only delays that retry until the lease ends.
func (g *guard) release(ctx context.Context, t *Ticket) {
	if t == nil {
		return
	}
	ctx, cancel := finishing(ctx)
	defer cancel()
	_, err := inSpan(ctx, g.tracer, "release", t.Key, func(ctx context.Context) (bool, error) {
		return t.release(ctx, g.db)
	}, releaseOutcome)
	if err != nil {
		g.opts.Logger.Printf("idempotency: release: %v", err)
	}
}

// unavailable fails closed: without the store, a retry could run twice.
// Nothing of the request committed.
func (g *guard) unavailable(w http.ResponseWriter, err error) {
	g.opts.Logger.Printf("idempotency: %v", err)
	writeProblem(w, http.StatusServiceUnavailable, CodeUnavailable,
		"the idempotency store is unavailable and this request was not carried out; retry later", 1)
}

// heldByLostClaim answers a claim asked again after its answer was lost,
// in one transaction, that found the key in progress: most likely held by
// that lost claim's own transaction, which never commits and lasts until
// the server learns its connection is gone (a half-open connection). Not a
// 409 for the request's own claim: a 503, nothing of it was kept.
func (g *guard) heldByLostClaim(w http.ResponseWriter, t *Ticket) {
	g.opts.Logger.Printf("idempotency: the claim asked again after its answer was lost found the key still held")
	writeProblem(w, http.StatusServiceUnavailable, CodeUnavailable,
		"the connection to the idempotency store was lost while this request was claimed; "+
			"nothing of it was kept; retry later", max(t.RetryAfter, 1))
}

// unknown answers a request whose COMMIT got no answer when the store cannot
// tell whether it committed: a retry with the same key learns it.
func (g *guard) unknown(w http.ResponseWriter, err error) {
	g.opts.Logger.Printf("idempotency: whether the request committed is unknown: %v", err)
	writeProblem(w, http.StatusServiceUnavailable, CodeUnavailable,
		"the idempotency store did not say whether this request was done; "+
			"retry with the same Idempotency-Key to get its answer", 1)
}

// max returns the larger of a and b.
func max(a, b int) int {
	if a > b {
		return a
	}
	return b
}
