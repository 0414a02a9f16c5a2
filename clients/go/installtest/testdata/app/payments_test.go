// A module of its own, outside the repository, that gets the client with
// go get as its users do (clients/go/test copies it to a scratch folder and
// serves the client from a module proxy made of this checkout), then uses
// it against the database at DATABASE_URL.
package payments

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/idempotency/idempotency/clients/go/idempotency"
	"github.com/jackc/pgx/v5/pgxpool"
)

// charge is a payment route: a row through the request's transaction.
func charge(w http.ResponseWriter, r *http.Request) {
	var id int64
	err := idempotency.Tx(r.Context()).QueryRow(r.Context(),
		`INSERT INTO installed_charges DEFAULT VALUES RETURNING id`).Scan(&id)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charge":%d}`, id)
}

func TestInstalledMiddleware(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS installed_charges
		(id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(idempotency.Middleware(pool, idempotency.Options{})(http.HandlerFunc(charge)))
	defer srv.Close()
	key := idempotency.NewToken()
	post := func() *http.Response {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":10}`))
		req.Header.Set("Idempotency-Key", `"`+key+`"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	if first := post(); first.StatusCode != 201 || first.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %d %v", first.StatusCode, first.Header)
	}
	if again := post(); again.StatusCode != 201 || again.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %v", again.StatusCode, again.Header)
	}
	record, err := idempotency.Lookup(ctx, pool, "", key)
	if err != nil || record == nil || record.State != "completed" || record.StatusCode != 201 {
		t.Fatalf("record: %+v %v", record, err)
	}
}
