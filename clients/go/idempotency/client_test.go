package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var ctx = context.Background()

// fp is the fingerprint of a payment of amount.
func fp(amount string) []byte {
	return Fingerprint("POST", "/payments", []byte(`{"amount":`+amount+`}`), nil)
}

// mustClaim claims and fails t on an error or an outcome other than want.
func mustClaim(t *testing.T, p ClaimParams, want Outcome) *Ticket {
	t.Helper()
	return mustClaimOn(t, pool, p, want)
}

// mustClaimOn is mustClaim on db.
func mustClaimOn(t *testing.T, db Querier, p ClaimParams, want Outcome) *Ticket {
	t.Helper()
	ticket, err := Claim(ctx, db, p)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if ticket.Outcome != want {
		t.Fatalf("claim: outcome %q, want %q", ticket.Outcome, want)
	}
	return ticket
}

// waitLeaseEnded waits until the lease of (scope, key) has ended on the database's clock.
func waitLeaseEnded(t *testing.T, scope, key string) {
	t.Helper()
	for i := 0; i < 100; i++ {
		var ended bool
		err := pool.QueryRow(ctx, `SELECT lease_expires_at < clock_timestamp()
			FROM idempotency.lookup($1, $2)`, key, scope).Scan(&ended)
		if err != nil {
			t.Fatal(err)
		}
		if ended {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("the lease did not end")
}

func TestClaimNewCompleteReplay(t *testing.T) {
	p := ClaimParams{Scope: "acct_1", Key: uniqueKey(t), Fingerprint: fp("10")}
	first := mustClaim(t, p, New)
	if first.Fence <= 0 || first.Attempt != 1 || first.CreatedAt.IsZero() {
		t.Fatalf("new: fence %d, attempt %d, created %v", first.Fence, first.Attempt, first.CreatedAt)
	}
	body := []byte{0, 1, 2, 0xff, '\r', '\n', 'x'}
	header := http.Header{"Content-Type": {"application/octet-stream"}, "X-Multi": {"a", "b"}}
	result, err := first.Complete(ctx, pool, 201, body, header)
	if err != nil || result != Stored {
		t.Fatalf("complete: %q, %v", result, err)
	}
	again := mustClaim(t, p, Replay)
	if again.StatusCode != 201 || !bytes.Equal(again.Body, body) || !reflect.DeepEqual(again.Header, header) {
		t.Fatalf("replay: %d %q %v", again.StatusCode, again.Body, again.Header)
	}
	if again.Fence != 0 || !again.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("replay: fence %d (want none), created %v (want %v)", again.Fence, again.CreatedAt, first.CreatedAt)
	}
}

func TestClaimInProgressAndMismatch(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("10"), Lease: 30 * time.Second}
	owner := mustClaim(t, p, New)
	busy := mustClaim(t, p, InProgress)
	if busy.RetryAfter < 1 || busy.RetryAfter > 30 || busy.Fence != 0 {
		t.Fatalf("in progress: retry after %d s, fence %d", busy.RetryAfter, busy.Fence)
	}
	other := p
	other.Fingerprint = fp("99")
	mismatch := mustClaim(t, other, Mismatch)
	if !mismatch.CreatedAt.Equal(owner.CreatedAt) {
		t.Fatalf("mismatch: created %v, want %v", mismatch.CreatedAt, owner.CreatedAt)
	}
	if _, err := owner.Complete(ctx, pool, 200, nil, nil); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, other, Mismatch)
}

func TestScopesDoNotMeet(t *testing.T) {
	key := uniqueKey(t)
	mustClaim(t, ClaimParams{Scope: "alice", Key: key, Fingerprint: fp("1")}, New)
	mustClaim(t, ClaimParams{Scope: "bob", Key: key, Fingerprint: fp("2")}, New)
	mustClaim(t, ClaimParams{Scope: "", Key: key, Fingerprint: fp("3")}, New)
	if r, err := Lookup(ctx, pool, "carol", key); r != nil || err != nil {
		t.Fatalf("lookup in another scope: %v, %v", r, err)
	}
}

func TestTakeoverFencesTheOldOwner(t *testing.T) {
	p := ClaimParams{Scope: "s", Key: uniqueKey(t), Fingerprint: fp("5"), Lease: 300 * time.Millisecond}
	old := mustClaim(t, p, New)
	state := json.RawMessage(`{"charge": 7}`)
	if err := old.Checkpoint(ctx, pool, "charged", state); err != nil {
		t.Fatal(err)
	}
	waitLeaseEnded(t, p.Scope, p.Key)
	next := mustClaim(t, p, New)
	if next.Attempt != 2 || next.Fence <= old.Fence {
		t.Fatalf("takeover: attempt %d, fence %d after %d", next.Attempt, next.Fence, old.Fence)
	}
	if next.RecoveryPoint != "charged" || string(next.RecoveryState) != string(state) {
		t.Fatalf("takeover: recovery %q %s", next.RecoveryPoint, next.RecoveryState)
	}

	_, err := old.Complete(ctx, pool, 201, []byte("late"), nil)
	var lost *ClaimLostError
	if !errors.As(err, &lost) || !errors.Is(err, ErrClaimLost) || lost.Fence != old.Fence || lost.Key != p.Key {
		t.Fatalf("complete with the old fence: %v", err)
	}
	if SQLState(err) != "IK001" {
		t.Fatalf("complete with the old fence: SQLSTATE %q", SQLState(err))
	}
	if _, err := old.Extend(ctx, pool, time.Minute); !errors.Is(err, ErrClaimLost) {
		t.Fatalf("extend with the old fence: %v", err)
	}
	if err := old.Checkpoint(ctx, pool, "again", nil); !errors.Is(err, ErrClaimLost) {
		t.Fatalf("checkpoint with the old fence: %v", err)
	}
	if released, err := old.Release(ctx, pool); released || err != nil {
		t.Fatalf("release with the old fence: %v, %v", released, err)
	}
	if result, err := next.Complete(ctx, pool, 201, []byte("won"), nil); result != Stored || err != nil {
		t.Fatalf("complete by the new owner: %q, %v", result, err)
	}
	if r := mustClaim(t, p, Replay); string(r.Body) != "won" {
		t.Fatalf("replay: %q", r.Body)
	}
}

func TestClaimLostRollsBackTheTransaction(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5"), Lease: 200 * time.Millisecond}
	old := mustClaim(t, p, New)
	waitLeaseEnded(t, p.Scope, p.Key)
	mustClaim(t, p, New)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := old.Complete(ctx, tx, 201, nil, nil); !errors.Is(err, ErrClaimLost) {
		t.Fatalf("complete: %v", err)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit after IK001 succeeded")
	}
}

func TestExtend(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5"), Lease: time.Second}
	owner := mustClaim(t, p, New)
	end, err := owner.Extend(ctx, pool, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if until := time.Until(end); until < 59*time.Minute || until > 61*time.Minute {
		t.Fatalf("extend by an hour: ends in %v", until)
	}
	r, err := Lookup(ctx, pool, "", p.Key)
	if err != nil || !r.LeaseExpiresAt.Equal(end) {
		t.Fatalf("lookup: lease ends %v, want %v (%v)", r.LeaseExpiresAt, end, err)
	}
	if busy := mustClaim(t, p, InProgress); busy.RetryAfter < 3500 {
		t.Fatalf("retry after %d s, want about an hour", busy.RetryAfter)
	}
}

func TestReleaseLetsTheNextRetryRun(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5")}
	owner := mustClaim(t, p, New)
	if released, err := owner.Release(ctx, pool); !released || err != nil {
		t.Fatalf("release: %v, %v", released, err)
	}
	if r, err := Lookup(ctx, pool, "", p.Key); r != nil || err != nil {
		t.Fatalf("lookup after release: %v, %v", r, err)
	}
	if again := mustClaim(t, p, New); again.Attempt != 1 {
		t.Fatalf("claim after release: attempt %d", again.Attempt)
	}
	if released, err := owner.Release(ctx, pool); released || err != nil {
		t.Fatalf("second release: %v, %v", released, err)
	}
}

func TestCompleteServerErrorReleases(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5")}
	owner := mustClaim(t, p, New)
	if result, err := owner.Complete(ctx, pool, 503, []byte("down"), nil); result != Released || err != nil {
		t.Fatalf("complete 503: %q, %v", result, err)
	}
	mustClaim(t, p, New)
}

func TestClaimWaitsForTheOwner(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5")}
	owner := mustClaim(t, p, New)
	done := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		_, err := owner.Complete(ctx, pool, 201, []byte("done"), nil)
		done <- err
	}()
	waiter := p
	waiter.Wait = 10 * time.Second
	started := time.Now()
	r := mustClaim(t, waiter, Replay)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if string(r.Body) != "done" || time.Since(started) > 5*time.Second {
		t.Fatalf("waited %v for %q", time.Since(started), r.Body)
	}
}

// Lookup and the calls of a Ticket, on pgx and through SQL on database/sql.
func TestLookup(t *testing.T) {
	for name, db := range map[string]Querier{"pgx": pool, "database/sql": SQL(sqlDB)} {
		t.Run(name, func(t *testing.T) { testLookup(t, db) })
	}
}

// testLookup claims, looks up, completes and looks up again on db.
func testLookup(t *testing.T, db Querier) {
	p := ClaimParams{Scope: "acct", Key: uniqueKey(t), Fingerprint: fp("5"), Lease: 45 * time.Second,
		Retention: 2 * time.Hour}
	if r, err := Lookup(ctx, db, p.Scope, p.Key); r != nil || err != nil {
		t.Fatalf("lookup of an absent key: %v, %v", r, err)
	}
	owner, err := Claim(ctx, db, p)
	if err != nil || owner.Outcome != New {
		t.Fatalf("claim: %+v, %v", owner, err)
	}
	r, err := Lookup(ctx, db, p.Scope, p.Key)
	if err != nil {
		t.Fatal(err)
	}
	if r.Scope != p.Scope || r.Key != p.Key || !bytes.Equal(r.Fingerprint, p.Fingerprint) ||
		r.State != "in_progress" || r.Attempt != 1 || r.Lease != 45*time.Second ||
		r.LeaseExpiresAt.IsZero() || r.StatusCode != 0 || !r.CompletedAt.IsZero() ||
		r.ExpiresAt.Sub(r.CreatedAt) != 2*time.Hour {
		t.Fatalf("lookup in progress: %+v", r)
	}
	header := http.Header{"Location": {"/payments/1"}}
	if _, err := owner.Complete(ctx, db, 201, []byte(`{"charge":1}`), header); err != nil {
		t.Fatal(err)
	}
	r, err = Lookup(ctx, db, p.Scope, p.Key)
	if err != nil {
		t.Fatal(err)
	}
	if r.State != "completed" || r.StatusCode != 201 || string(r.Body) != `{"charge":1}` ||
		!reflect.DeepEqual(r.Header, header) || r.CompletedAt.IsZero() ||
		r.Lease != 0 || !r.LeaseExpiresAt.IsZero() {
		t.Fatalf("lookup completed: %+v", r)
	}
}

func TestBadArgumentsAreRefused(t *testing.T) {
	good := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("5")}
	cases := []struct {
		name  string
		edit  func(p *ClaimParams)
		state string
	}{
		{"nil fingerprint", func(p *ClaimParams) { p.Fingerprint = nil }, "22004"},
		{"empty key", func(p *ClaimParams) { p.Key = "" }, "22023"},
		{"key over 255 bytes", func(p *ClaimParams) { p.Key = strings.Repeat("k", 256) }, "22023"},
		{"control character in key", func(p *ClaimParams) { p.Key = "a\x01b" }, "22023"},
		{"empty fingerprint", func(p *ClaimParams) { p.Fingerprint = []byte{} }, "22023"},
		{"fingerprint over 64 bytes", func(p *ClaimParams) { p.Fingerprint = make([]byte, 65) }, "22023"},
		{"negative lease", func(p *ClaimParams) { p.Lease = -time.Second }, "22023"},
		{"negative wait", func(p *ClaimParams) { p.Wait = -time.Second }, "22023"},
		{"negative retention", func(p *ClaimParams) { p.Retention = -time.Hour }, "22023"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := good
			c.edit(&p)
			_, err := Claim(ctx, pool, p)
			if SQLState(err) != c.state || errors.Is(err, ErrClaimLost) {
				t.Fatalf("got %v, want SQLSTATE %s", err, c.state)
			}
		})
	}
	if r, err := Lookup(ctx, pool, "", good.Key); r != nil || err != nil {
		t.Fatalf("a refused claim wrote: %v, %v", r, err)
	}

	owner := mustClaim(t, good, New)
	completes := []struct {
		name   string
		status int
		body   []byte
		state  string
	}{
		{"status over 599", 600, nil, "22023"},
		{"status under 100", 99, nil, "22023"},
		{"body over idempotency.max_response_bytes", 200, make([]byte, 1<<20+1), "54000"},
	}
	for _, c := range completes {
		t.Run(c.name, func(t *testing.T) {
			_, err := owner.Complete(ctx, pool, c.status, c.body, nil)
			if SQLState(err) != c.state || errors.Is(err, ErrClaimLost) {
				t.Fatalf("got %v, want SQLSTATE %s", err, c.state)
			}
		})
	}
	if r, err := Lookup(ctx, pool, "", good.Key); err != nil || r.State != "in_progress" {
		t.Fatalf("a refused complete changed the record: %+v, %v", r, err)
	}
}

func TestClaimInReadOnlyTransaction(t *testing.T) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	_, err = Claim(ctx, tx, ClaimParams{Key: uniqueKey(t), Fingerprint: fp("1")})
	if SQLState(err) != "25006" {
		t.Fatalf("claim in a read-only transaction: %v, want SQLSTATE 25006", err)
	}
}

// A claim asked again with its token answers New with the same fence while
// it is in progress; another token (or none) gets in_progress, and once
// completed the token replays like any claim.
func TestClaimToken(t *testing.T) {
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("3"), Token: NewToken()}
	first := mustClaim(t, p, New)
	again := mustClaim(t, p, New)
	if again.Fence != first.Fence || again.Attempt != first.Attempt {
		t.Fatalf("asked again: fence %d attempt %d, want %d and %d", again.Fence, again.Attempt, first.Fence, first.Attempt)
	}
	other := p
	other.Token = NewToken()
	mustClaim(t, other, InProgress)
	other.Token = ""
	mustClaim(t, other, InProgress)
	if _, err := first.Complete(ctx, pool, 201, []byte("done"), nil); err != nil {
		t.Fatal(err)
	}
	if r := mustClaim(t, p, Replay); string(r.Body) != "done" {
		t.Fatalf("replay %q", r.Body)
	}
	if a, b := NewToken(), NewToken(); a == b || len(a) != 36 || a[14] != '4' || !strings.ContainsAny(a[19:20], "89ab") {
		t.Fatalf("tokens %s and %s are not distinct UUIDs v4", a, b)
	}
}

// TestBytesWhateverByteaOutput replays the body and looks up the
// fingerprint through connections where a DBA set bytea_output = escape,
// which changes how bytea travels as text.
func TestBytesWhateverByteaOutput(t *testing.T) {
	config := pool.Config().Copy()
	config.ConnConfig.RuntimeParams["bytea_output"] = "escape"
	escaped, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	defer escaped.Close()
	p := ClaimParams{Scope: "acct_e", Key: uniqueKey(t), Fingerprint: fp("7")}
	body := []byte{0, '\\', 0x7f, 0xff, '\'', 'A'}
	if _, err := mustClaimOn(t, escaped, p, New).Complete(ctx, escaped, 201, body, nil); err != nil {
		t.Fatal(err)
	}
	if again := mustClaimOn(t, escaped, p, Replay); !bytes.Equal(again.Body, body) {
		t.Fatalf("replay: body %q, want %q", again.Body, body)
	}
	r, err := Lookup(ctx, escaped, p.Scope, p.Key)
	if err != nil || !bytes.Equal(r.Body, body) || !bytes.Equal(r.Fingerprint, p.Fingerprint) {
		t.Fatalf("lookup: %+v, %v", r, err)
	}
}
