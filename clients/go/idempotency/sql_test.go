package idempotency

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
)

// serveSQL starts a test server of handler h behind MiddlewareSQL on sqlDB.
func serveSQL(t *testing.T, h http.HandlerFunc) *httptest.Server {
	return serveGuarded(t, sqlStore{SQL(sqlDB), sqlDB}, Options{}, h)
}

// Behind MiddlewareSQL the handler writes through SQLTx: the write and the
// stored response commit together, a replay does not run it, a 5xx rolls
// back and releases.
func TestSQLMiddleware(t *testing.T) {
	var runs int32
	srv := serveSQL(t, func(w http.ResponseWriter, r *http.Request) {
		if Tx(r.Context()) != nil || SQLTx(r.Context()) == nil {
			w.WriteHeader(500)
			return
		}
		charge(&runs)(w, r)
	})
	c := keyed(uniqueKey(t), `{"amount":1}`)
	first := send(t, srv, c)
	again := send(t, srv, c)
	if first.status != 201 || again.status != 201 || string(again.body) != string(first.body) ||
		again.header.Get("Idempotent-Replayed") != "true" || runs != 1 || writesOf(t, c.header["X-Key"]) != 1 {
		t.Fatalf("first %d %q, again %d %q; %d runs, %d writes", first.status, first.body,
			again.status, again.body, runs, writesOf(t, c.header["X-Key"]))
	}
	var declined int32
	wantReleasedTwice(t, serveSQL(t, declining(&declined)), keyed(uniqueKey(t), `{}`))
}

// Through SQL, IK001 is a *ClaimLostError and rolls back the *sql.Tx.
func TestSQLClaimLost(t *testing.T) {
	db := SQL(sqlDB)
	p := ClaimParams{Key: uniqueKey(t), Fingerprint: fp("1")}
	owner, err := Claim(ctx, db, p)
	if err != nil || owner.Outcome != New {
		t.Fatalf("claim: %+v %v", owner, err)
	}
	if ok, err := owner.Release(ctx, db); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	tx, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = owner.Complete(ctx, SQL(tx), 201, nil, nil)
	var lost *ClaimLostError
	if !errors.As(err, &lost) || !errors.Is(err, ErrClaimLost) || lost.Fence != owner.Fence {
		t.Fatalf("complete after release: %v", err)
	}
}
