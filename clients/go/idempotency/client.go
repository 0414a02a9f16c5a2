// Package idempotency makes HTTP APIs safe to retry with the idempotency
// PostgreSQL extension: a client for its SQL API (Claim, then Complete,
// Release, Extend or Checkpoint on the Ticket it returns; Lookup), the
// extension's request fingerprint computed in Go, and net/http middleware
// that follows the project's HTTP contract (docs/http-contract.md).
//
// Every call runs on a Querier: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx,
// or a database/sql handle through SQL.
// Claim on the pool, so that the claim commits at once and a concurrent retry
// sees it; Complete in the transaction of the business writes, so that they
// and the stored response commit together.
package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier runs statements: *pgxpool.Pool, *pgx.Conn and pgx.Tx all are one.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Outcome is claim's answer.
type Outcome string

// The outcomes of a claim.
const (
	New        Outcome = "new"         // run the request, then Complete or Release
	Replay     Outcome = "replay"      // send the stored response again
	InProgress Outcome = "in_progress" // another attempt holds the lease: 409
	Mismatch   Outcome = "mismatch"    // the key belongs to another request: 422
)

// What Complete returns.
const (
	Stored   = "stored"   // the response is kept and replayed
	Released = "released" // a 5xx: nothing is kept, the next retry runs again
)

// SQLSTATE codes the extension raises that the package acts on.
const (
	codeInvalidArg = "22023" // a key, fingerprint, interval or response refused
	codeClaimLost  = "IK001" // the fence no longer owns the claim
)

// ErrClaimLost matches (errors.Is) every *ClaimLostError.
var ErrClaimLost = errors.New("idempotency: the fence no longer owns the claim")

// ClaimLostError is IK001: the claim was taken over, released or reaped, so
// this fence may no longer complete, extend or checkpoint it. Returned inside
// a transaction, it means that transaction must roll back.
type ClaimLostError struct {
	Scope, Key string
	Fence      int64
	Err        *pgconn.PgError // the server's error
}

// Error says which claim was lost.
func (e *ClaimLostError) Error() string {
	return fmt.Sprintf("idempotency: fence %d no longer owns key %q: %s", e.Fence, e.Key, e.Err.Message)
}

// Unwrap gives the server's error.
func (e *ClaimLostError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrClaimLost) true.
func (e *ClaimLostError) Is(target error) bool { return target == ErrClaimLost }

// ClaimParams are the arguments of Claim.
type ClaimParams struct {
	Scope       string        // whose key: an account, a tenant, a hash of the credential; "" is unscoped
	Key         string        // the client's Idempotency-Key, 1..255 bytes
	Fingerprint []byte        // the request's hash (Fingerprint); nil raises 22004
	Lease       time.Duration // how long the owner may work before a retry takes over; 0: idempotency.lease
	Retention   time.Duration // how long the answer is replayed; 0: idempotency.retention
	Wait        time.Duration // wait this long for an owner in progress; 0: answer at once
	Token       string        // this attempt's id (NewToken), so that a claim whose answer was lost can be asked again; "" for none
}

// Ticket is what Claim hands back. With outcome New it holds the fence that
// lets its holder Complete, Release, Extend or Checkpoint the claim.
type Ticket struct {
	Scope, Key    string
	Outcome       Outcome
	Fence         int64           // New: the fencing token of this owner
	Attempt       int             // New: 1, or more for a takeover of an ended lease
	RecoveryPoint string          // New after a takeover: what the last owner checkpointed
	RecoveryState json.RawMessage // New after a takeover; nil when none
	StatusCode    int             // Replay: the stored response
	Header        http.Header     // Replay
	Body          []byte          // Replay
	RetryAfter    int             // InProgress: whole seconds until the lease ends, at least 1
	CreatedAt     time.Time       // when the key was first claimed; zero when its claim has not committed yet
}

// Bytes come back as hex text (see hexBytes).
const claimSQL = `SELECT outcome, fence, attempt, status_code, headers, encode(body, 'hex'),
       recovery_point, recovery_state, retry_after, created_at
  FROM idempotency.claim($1, $2, $3, $4, $5, $6, $7)`

// Claim claims p.Key for the request p.Fingerprint identifies: the one call
// that decides whether to run a request (see Outcome). With p.Token, a claim
// whose answer was lost can be asked again with the same token: while the
// claim it made is in progress, that answers New with the same fence.
// Needs extension version 1.2. Traced as the span idempotency.claim of the
// global tracer provider (see the README).
func Claim(ctx context.Context, db Querier, p ClaimParams) (*Ticket, error) {
	return inSpan(ctx, tracerOf(nil), "claim", p.Key, func(ctx context.Context) (*Ticket, error) {
		return claimOn(ctx, db, p)
	}, claimOutcome)
}

// claimOn is Claim untraced.
func claimOn(ctx context.Context, db Querier, p ClaimParams) (*Ticket, error) {
	return scanTicket(db.QueryRow(ctx, claimSQL, unnamed(claimArgs(p)...)...), p)
}

// claimArgs are the arguments of claimSQL for p.
func claimArgs(p ClaimParams) []any {
	return []any{p.Key, p.Fingerprint, p.Scope, interval(p.Lease), interval(p.Retention),
		interval(p.Wait), nullIfEmpty(p.Token)}
}

// scanTicket reads the row of claimSQL.
func scanTicket(row pgx.Row, p ClaimParams) (*Ticket, error) {
	t := &Ticket{Scope: p.Scope, Key: p.Key}
	var (
		fence                  *int64
		attempt, status, retry *int32
		headers, state         []byte
		recoveryPoint          *string
		createdAt              *time.Time // NULL for a claim still being written by another transaction
	)
	err := row.Scan(&t.Outcome, &fence, &attempt, &status,
		&headers, hexBytes{&t.Body}, &recoveryPoint, &state, &retry, &createdAt)
	if err != nil {
		return nil, fmt.Errorf("idempotency: claim: %w", err)
	}
	t.Fence = deref(fence)
	t.Attempt = int(deref(attempt))
	t.StatusCode = int(deref(status))
	t.RetryAfter = int(deref(retry))
	t.RecoveryPoint = deref(recoveryPoint)
	t.RecoveryState = state
	t.CreatedAt = deref(createdAt)
	if t.Header, err = decodeHeader(headers); err != nil {
		return nil, fmt.Errorf("idempotency: claim: %w", err)
	}
	return t, nil
}

// Complete stores the response (status, body, the header given) and ends
// the claim; run it in the transaction of the request's business writes.
// Returns Stored, or Released for a 5xx. A *ClaimLostError when this fence
// lost the claim: roll that transaction back. Traced as the span
// idempotency.complete of the global tracer provider.
func (t *Ticket) Complete(ctx context.Context, db Querier, status int, body []byte, header http.Header) (string, error) {
	return inSpan(ctx, tracerOf(nil), "complete", t.Key, func(ctx context.Context) (string, error) {
		return t.complete(ctx, db, status, body, header)
	}, completeOutcome)
}

// complete is Complete untraced.
func (t *Ticket) complete(ctx context.Context, db Querier, status int, body []byte, header http.Header) (string, error) {
	args, err := t.completeArgs(status, body, header)
	if err != nil {
		return "", err
	}
	var result string
	if err := db.QueryRow(ctx, completeSQL, unnamed(args...)...).Scan(&result); err != nil {
		return "", t.wrap("complete", err)
	}
	return result, nil
}

const completeSQL = `SELECT idempotency.complete($1, $2, $3, $4, $5, $6)`

// completeArgs are the arguments of completeSQL.
func (t *Ticket) completeArgs(status int, body []byte, header http.Header) ([]any, error) {
	headers, err := encodeHeader(header)
	if err != nil {
		return nil, fmt.Errorf("idempotency: complete: %w", err)
	}
	return []any{t.Key, t.Fence, status, body, headers, t.Scope}, nil
}

// Release deletes the claim so that the next retry runs the request again.
// False when this fence no longer owns an in-progress claim. Traced as the
// span idempotency.release of the global tracer provider.
func (t *Ticket) Release(ctx context.Context, db Querier) (bool, error) {
	return inSpan(ctx, tracerOf(nil), "release", t.Key, func(ctx context.Context) (bool, error) {
		return t.release(ctx, db)
	}, releaseOutcome)
}

// release is Release untraced.
func (t *Ticket) release(ctx context.Context, db Querier) (bool, error) {
	var released bool
	err := db.QueryRow(ctx, `SELECT idempotency.release($1, $2, $3)`,
		unnamed(t.Key, t.Fence, t.Scope)...).Scan(&released)
	if err != nil {
		return false, t.wrap("release", err)
	}
	return released, nil
}

// Extend renews the lease from now by lease (0: the claim's own lease
// length) and returns its new end.
func (t *Ticket) Extend(ctx context.Context, db Querier, lease time.Duration) (time.Time, error) {
	var end time.Time
	err := db.QueryRow(ctx, `SELECT idempotency.extend($1, $2, $3, $4)`,
		unnamed(t.Key, t.Fence, interval(lease), t.Scope)...).Scan(&end)
	if err != nil {
		return time.Time{}, t.wrap("extend", err)
	}
	return end, nil
}

// Checkpoint saves the progress of multi-step work (point, and state as
// JSON, nil for none) and renews the lease; a takeover's Ticket carries them.
func (t *Ticket) Checkpoint(ctx context.Context, db Querier, point string, state json.RawMessage) error {
	if _, err := db.Exec(ctx, checkpointSQL, unnamed(t.checkpointArgs(point, state)...)...); err != nil {
		return t.wrap("checkpoint", err)
	}
	return nil
}

const checkpointSQL = `SELECT idempotency.checkpoint($1, $2, $3, $4, $5)`

// checkpointArgs are the arguments of checkpointSQL.
func (t *Ticket) checkpointArgs(point string, state json.RawMessage) []any {
	return []any{t.Key, t.Fence, point, jsonArg(state), t.Scope}
}

// wrap names the call in err, and turns IK001 into a *ClaimLostError.
func (t *Ticket) wrap(call string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == codeClaimLost {
		return &ClaimLostError{Scope: t.Scope, Key: t.Key, Fence: t.Fence, Err: pgErr}
	}
	return fmt.Errorf("idempotency: %s: %w", call, err)
}

// Record is a key's record as Lookup shows it: every column but the fence.
type Record struct {
	Scope, Key     string
	Fingerprint    []byte
	State          string // "in_progress" or "completed"
	Attempt        int
	Lease          time.Duration // zero once completed
	LeaseExpiresAt time.Time     // zero when none (once completed)
	RecoveryPoint  string
	RecoveryState  json.RawMessage
	StatusCode     int // 0 while in progress
	Header         http.Header
	Body           []byte
	CreatedAt      time.Time
	CompletedAt    time.Time // zero while in progress
	ExpiresAt      time.Time
}

// The lease in microseconds: database/sql reads an interval as text; bytes
// as hex text (see hexBytes).
const lookupSQL = `SELECT scope, key, encode(fingerprint, 'hex'), state, attempt,
       (extract(epoch FROM lease) * 1000000)::bigint, lease_expires_at,
       recovery_point, recovery_state, status_code, headers, encode(body, 'hex'),
       created_at, completed_at, expires_at
  FROM idempotency.lookup($1, $2)`

// Lookup reads the record of (scope, key) as Claim would see it; nil when it
// is absent or expired. It only reads: it works on a standby.
func Lookup(ctx context.Context, db Querier, scope, key string) (*Record, error) {
	r := &Record{}
	var (
		status                *int32
		leaseMicros           *int64
		leaseEnd, completedAt *time.Time
		recoveryPoint         *string
		headers, state        []byte
	)
	err := db.QueryRow(ctx, lookupSQL, unnamed(key, scope)...).Scan(&r.Scope, &r.Key, hexBytes{&r.Fingerprint},
		&r.State, &r.Attempt, &leaseMicros, &leaseEnd, &recoveryPoint, &state, &status, &headers,
		hexBytes{&r.Body}, &r.CreatedAt, &completedAt, &r.ExpiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("idempotency: lookup: %w", err)
	}
	r.Lease = time.Duration(deref(leaseMicros)) * time.Microsecond
	r.LeaseExpiresAt = deref(leaseEnd)
	r.CompletedAt = deref(completedAt)
	r.RecoveryPoint = deref(recoveryPoint)
	r.RecoveryState = state
	r.StatusCode = int(deref(status))
	if r.Header, err = decodeHeader(headers); err != nil {
		return nil, fmt.Errorf("idempotency: lookup: %w", err)
	}
	return r, nil
}

// SQLState returns the SQLSTATE of the server error inside err, "" if none.
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// NewToken returns a random UUID (version 4) for ClaimParams.Token: one per
// incoming request.
func NewToken() string {
	var b [16]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// unnamed is args with pgx.QueryExecModeExec first, so that the statement
// travels unnamed (Parse, Bind and Execute in one round trip, as with a
// prepared one), whatever the pool's DefaultQueryExecMode. pgx's default
// prepares named statements per connection, which a transaction pooler
// (pgbouncer before 1.21) does not keep: the next transaction may run on
// another server connection, where the name is missing (26000), taken
// (42P05) or another client's statement. database/sql on pgx's stdlib
// driver passes the mode through to pgx.
func unnamed(args ...any) []any {
	return append([]any{pgx.QueryExecModeExec}, args...)
}

// nullIfEmpty is s as an argument: NULL when empty.
func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// interval is d as an interval argument: NULL (the setting) when zero.
func interval(d time.Duration) any {
	if d == 0 {
		return nil
	}
	return d
}

// jsonArg is j as a jsonb argument: NULL when nil.
func jsonArg(j json.RawMessage) any {
	if j == nil {
		return nil
	}
	return string(j)
}

// encodeHeader turns h into the JSON object complete stores: a string per
// single value, an array for several; NULL when h is empty.
func encodeHeader(h http.Header) (any, error) {
	if len(h) == 0 {
		return nil, nil
	}
	obj := make(map[string]any, len(h))
	for name, values := range h {
		if len(values) == 1 {
			obj[name] = values[0]
		} else {
			obj[name] = values
		}
	}
	j, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	return string(j), nil
}

// decodeHeader reads stored headers (a JSON object of strings or arrays of
// strings) into an http.Header; nil for NULL.
func decodeHeader(j []byte) (http.Header, error) {
	if j == nil {
		return nil, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(j, &obj); err != nil {
		return nil, fmt.Errorf("stored headers: %w", err)
	}
	h := make(http.Header, len(obj))
	for name, raw := range obj {
		var one string
		if json.Unmarshal(raw, &one) == nil {
			h[http.CanonicalHeaderKey(name)] = []string{one}
			continue
		}
		var many []string
		if err := json.Unmarshal(raw, &many); err != nil {
			return nil, fmt.Errorf("stored header %q: %w", name, err)
		}
		h[http.CanonicalHeaderKey(name)] = many
	}
	return h, nil
}

// deref is *p, or T's zero value for a nil p (a NULL column).
func deref[T any](p *T) T {
	if p == nil {
		var zero T
		return zero
	}
	return *p
}

// hexBytes scans a column selected as encode(..., 'hex') into dst (nil for
// NULL). The claim and lookup read bytea as hex text because their results
// travel as text (QueryExecModeExec, database/sql), where bytea follows the
// server's bytea_output, which a DBA may set to escape.
type hexBytes struct{ dst *[]byte }

// Scan decodes the hex text src.
func (h hexBytes) Scan(src any) error {
	var text string
	switch v := src.(type) {
	case nil:
		*h.dst = nil
		return nil
	case string:
		text = v
	case []byte:
		text = string(v)
	default:
		return fmt.Errorf("idempotency: hex bytes: unexpected %T", src)
	}
	decoded, err := hex.DecodeString(text)
	if err != nil {
		return fmt.Errorf("idempotency: hex bytes: %w", err)
	}
	*h.dst = decoded
	return nil
}
