// The retried-payment API: POST /payments charges once per Idempotency-Key.
//
// Environment: DATABASE_URL (a database where CREATE EXTENSION idempotency
// is done), PORT (default 3000); for the tests, IDEMPOTENCY_LEASE (an
// interval; unset: the database's idempotency.lease), IDEMPOTENCY_FAIL_OPEN=on and
// IDEMPOTENCY_ONE_TRANSACTION=on (the claim in the charge's transaction).
// With WEBHOOK_SECRET (whsec_...), it also serves POST /webhooks: a Standard
// Webhooks receiver that charges each event's data.amount once.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idempotency/idempotency/clients/go/idempotency"
	"github.com/jackc/pgx/v5/pgxpool"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

const createCharges = `CREATE TABLE IF NOT EXISTS charges (
	id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	amount numeric NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now())`

// main connects, creates the table when missing, and serves until SIGTERM.
func main() {
	ctx := context.Background()
	pool, err := connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, createCharges); err != nil {
		log.Fatal(err)
	}
	lease, err := leaseOf(ctx, pool, os.Getenv("IDEMPOTENCY_LEASE"))
	if err != nil {
		log.Fatalf("IDEMPOTENCY_LEASE: %v", err)
	}
	// The charge is a row in this database and nothing else, so the claim
	// could commit with it (OneTransaction); a route that calls a payment
	// provider keeps the default, two transactions. The scope is the
	// default, a hash of the credential, which the conformance suite checks;
	// behind your authentication, pass the principal instead:
	// Scope: func(r *http.Request) string { return accountFrom(r.Context()) }.
	guard := idempotency.Middleware(pool, idempotency.Options{
		Lease:          lease,
		FailOpen:       os.Getenv("IDEMPOTENCY_FAIL_OPEN") == "on",
		OneTransaction: os.Getenv("IDEMPOTENCY_ONE_TRANSACTION") == "on",
	})
	mux := http.NewServeMux()
	mux.HandleFunc("/", health)
	mux.HandleFunc("/payments", pay)
	routes := http.NewServeMux()
	routes.Handle("/", guard(mux))
	if secret := os.Getenv("WEBHOOK_SECRET"); secret != "" {
		hooks, err := webhookGuard(pool, secret, lease)
		if err != nil {
			log.Fatalf("WEBHOOK_SECRET: %v", err)
		}
		routes.Handle("/webhooks", hooks(http.HandlerFunc(receive)))
	}
	srv := &http.Server{Addr: "127.0.0.1:" + getenv("PORT", "3000"), Handler: routes,
		ReadHeaderTimeout: 10 * time.Second}
	serve(srv)
}

// webhookGuard is the middleware of POST /webhooks: each delivery verified
// with the Standard Webhooks library (signature, and a timestamp within 5
// minutes) before anything is claimed, keyed by its webhook-id, scoped to
// the sender. Its charge and its stored answer commit together.
func webhookGuard(pool *pgxpool.Pool, secret string, lease time.Duration) (func(http.Handler) http.Handler, error) {
	wh, err := standardwebhooks.NewWebhook(secret)
	if err != nil {
		return nil, err
	}
	opts := idempotency.StandardWebhook(wh, "payments-sender")
	opts.Lease = lease
	return idempotency.Middleware(pool, opts), nil
}

// connect opens a pool on url; an unreachable database fails a request
// within 5 seconds (503) instead of hanging it.
func connect(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// leaseOf reads a PostgreSQL interval ("1 second", "00:01:00") as the
// database does; "" is 0, which leaves the lease to idempotency.lease.
func leaseOf(ctx context.Context, pool *pgxpool.Pool, text string) (time.Duration, error) {
	var d time.Duration
	if text == "" {
		return 0, nil
	}
	err := pool.QueryRow(ctx, `SELECT $1::text::interval`, text).Scan(&d)
	return d, err
}

// serve listens until SIGTERM or SIGINT, then lets requests in flight finish.
func serve(srv *http.Server) {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	}()
	log.Printf("listening on http://%s", srv.Addr)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
}

// health answers GET / without the database.
func health(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// payment is the body of POST /payments.
type payment struct {
	Amount  any     `json:"amount"`   // a JSON number over 0
	DelayMs float64 `json:"delay_ms"` // test knob: sleep this long first
	Fail    bool    `json:"fail"`     // test knob: charge, then answer 500
}

// event is the body of a webhook delivery: a payment to charge in data.
type event struct {
	Type string  `json:"type"`
	Data payment `json:"data"`
}

// pay charges the amount in the middleware's transaction: the charge and the
// stored response commit together. delay_ms sleeps first; fail answers 500
// after the charge was written, so the middleware rolls it back.
func pay(w http.ResponseWriter, r *http.Request) {
	var p payment
	if decodePost(w, r, &p) {
		charge(w, r, p)
	}
}

// receive charges a webhook event's data as POST /payments charges its body.
func receive(w http.ResponseWriter, r *http.Request) {
	var e event
	if decodePost(w, r, &e) {
		charge(w, r, e.Data)
	}
}

// decodePost reads the JSON body of a POST into v (numbers kept as
// written), or answers 405 or 400 and returns false.
func decodePost(w http.ResponseWriter, r *http.Request, v any) bool {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"error": "use POST"})
		return false
	}
	dec := json.NewDecoder(r.Body)
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "the body is not valid JSON"})
		return false
	}
	return true
}

// charge writes the charge of p in the middleware's transaction and
// answers 201 {"charge": id}.
func charge(w http.ResponseWriter, r *http.Request, p payment) {
	amount, ok := p.Amount.(json.Number)
	if f, err := amount.Float64(); !ok || err != nil || !(f > 0) {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "amount must be a positive number"})
		return
	}
	select {
	case <-time.After(time.Duration(p.DelayMs * float64(time.Millisecond))):
	case <-r.Context().Done():
		return
	}
	var id int64
	err := idempotency.Tx(r.Context()).QueryRow(r.Context(),
		`INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id`, amount.String()).Scan(&id)
	if err != nil {
		log.Printf("charge: %v", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "the charge failed"})
		return
	}
	if p.Fail {
		writeJSON(w, http.StatusInternalServerError,
			map[string]string{"error": fmt.Sprintf("charge %d was declined", id)})
		return
	}
	writeJSON(w, http.StatusCreated, map[string]int64{"charge": id})
}

// writeJSON answers status with v as JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	body, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}

// getenv is the environment variable name, or fallback when it is unset or empty.
func getenv(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}
