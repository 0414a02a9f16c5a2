// Command overhead measures what the middleware costs per request: database
// round trips and latency of a fresh request and of a replay, against the
// same route without the middleware and under the hand-written recipe
// (recipe.go), in both of the middleware's modes. Run it with clients/go/bench/overhead,
// which builds it (GOPATH mode, Debian's Go):
//
//	DATABASE_URL=... clients/go/bench/overhead [REQUESTS]
//
// The payment route (insert a charge, answer 201 {"charge": id}) is served
// six times, each by net/http in a process of its own on 127.0.0.1:
// "guarded", behind the middleware, writing through idempotency.Tx; "one",
// the same in the middleware's one-transaction mode; "guarded+prepare" and
// "one+prepare", the same with Options.Prepare; "recipe", under the
// hand-written recipe; and "plain", in a transaction of its own per request
// (BEGIN, insert, COMMIT), as the middleware would give it. One client sends
// REQUESTS (default 2000) sequential requests of each kind (plain; a fresh
// key and a replayed key to each of the others) over one kept-alive
// connection per server. With PROFILE_DIR, each server writes its CPU
// profile there (MODE.pprof). The kinds take turns, 100 timed requests at a time
// after 20 untimed, so that other load on the machine weighs on each alike;
// it prints the median and 90th percentile, and the speed of each mode
// against the recipe (the recipe's median over the mode's: above 1.0x, the
// middleware is faster). The recipe's statements are pgx's default, prepared
// once per connection; RECIPE_UNNAMED=on sends them unnamed, parsed and
// planned on every call, as the middleware sends its own (so that it works
// through a transaction pooler). Each server counts the ReadyForQuery messages its pool's
// connections receive, one per round trip (a count of the bytes read, cheap
// enough to stay on while timing); GET /stats reports the count.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency/idempotency/clients/go/idempotency"
	"github.com/idempotency/idempotency/clients/go/internal/roundtrip"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	warmup = 20  // untimed requests before each batch
	batch  = 100 // timed requests of one kind in a row
	body   = `{"amount":10}`
)

// main runs the benchmark, or with "serve MODE" one of its servers.
func main() {
	log.SetFlags(0)
	if len(os.Args) == 3 && os.Args[1] == "serve" {
		serve(os.Args[2])
		return
	}
	requests := 2000
	if len(os.Args) > 1 {
		n, err := strconv.Atoi(os.Args[1])
		if err != nil || n < batch {
			log.Fatalf("usage: overhead [REQUESTS, at least %d]", batch)
		}
		requests = n
	}
	run(requests / batch)
}

// kind is one kind of request: the server it goes to and its keys.
type kind struct {
	name      string
	server    *server
	key       func() string // "" sends no Idempotency-Key
	latencies []time.Duration
	trips     int64 // round trips during the timed requests
}

// run sends batches rounds of each kind and prints the table.
func run(batches int) {
	plain := start("plain")
	defer plain.stop()
	kinds := []*kind{{name: "plain", server: plain, key: func() string { return "" }}}
	medians := map[string]float64{}
	for _, mode := range []string{"guarded", "one", "guarded+prepare", "one+prepare", "recipe"} {
		s := start(mode)
		defer s.stop()
		replayed := "replay-" + random()
		kinds = append(kinds,
			&kind{name: mode + " fresh", server: s, key: func() string { return "fresh-" + random() }},
			&kind{name: mode + " replay", server: s, key: func() string { return replayed }})
	}
	for b := 0; b < batches; b++ {
		for _, k := range kinds {
			for i := 0; i < warmup; i++ {
				k.server.pay(k.key())
			}
			before := k.server.stats()
			for i := 0; i < batch; i++ {
				k.latencies = append(k.latencies, k.server.pay(k.key()))
			}
			k.trips += k.server.stats() - before
		}
	}
	fmt.Printf("%d sequential requests of each kind, latency in µs (guarded: two transactions; one: one"+
		" transaction; +prepare: Options.Prepare; recipe: hand-written):\n", batches*batch)
	fmt.Printf("%-23s%8s%8s%13s\n", "request", "median", "p90", "round trips")
	for _, k := range kinds {
		sort.Slice(k.latencies, func(i, j int) bool { return k.latencies[i] < k.latencies[j] })
		medians[k.name] = micros(quantile(k.latencies, 0.5))
		fmt.Printf("%-23s%8.0f%8.0f%13.1f\n", k.name, medians[k.name],
			micros(quantile(k.latencies, 0.9)), float64(k.trips)/float64(len(k.latencies)))
	}
	fmt.Printf("\nours ÷ hand-written (the recipe's median over ours; above 1.0x ours is faster):\n")
	fmt.Printf("%-28s%8s%8s\n", "mode", "fresh", "replay")
	for _, mode := range [][2]string{{"guarded", "two transactions"}, {"one", "one transaction"},
		{"guarded+prepare", "two transactions, Prepare"}, {"one+prepare", "one transaction, Prepare"}} {
		fmt.Printf("%-28s%7.2fx%7.2fx\n", mode[1], medians["recipe fresh"]/medians[mode[0]+" fresh"],
			medians["recipe replay"]/medians[mode[0]+" replay"])
	}
}

// quantile returns the q-quantile of sorted durations (linear interpolation).
func quantile(sorted []time.Duration, q float64) time.Duration {
	pos := q * float64(len(sorted)-1)
	i := int(pos)
	if i+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	return sorted[i] + time.Duration((pos-float64(i))*float64(sorted[i+1]-sorted[i]))
}

// micros is d in microseconds.
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// random returns 12 random hex digits.
func random() string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		log.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// server is a server process and a client with one connection to it.
type server struct {
	cmd    *exec.Cmd
	stdin  io.Closer // the server exits when it closes, as when this process ends
	url    string
	client *http.Client
}

// start runs this program as the server of mode; returns once it listens.
func start(mode string) *server {
	self, err := os.Executable()
	if err != nil {
		log.Fatal(err)
	}
	cmd := exec.Command(self, "serve", mode)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		log.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		log.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		log.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		log.Fatalf("the %s server did not start: %v", mode, err)
	}
	transport := &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}
	return &server{cmd: cmd, stdin: stdin, url: "http://" + strings.TrimSpace(line), client: &http.Client{Transport: transport}}
}

// stop ends the server process.
func (s *server) stop() {
	s.stdin.Close()
	s.cmd.Wait()
}

// pay sends one payment (key "" sends none); returns its latency.
func (s *server) pay(key string) time.Duration {
	req, err := http.NewRequest(http.MethodPost, s.url+"/payments", strings.NewReader(body))
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer bench")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	began := time.Now()
	resp, err := s.client.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	elapsed := time.Since(began)
	if err != nil || resp.StatusCode != http.StatusCreated {
		log.Fatalf("POST /payments: %d %v", resp.StatusCode, err)
	}
	return elapsed
}

// stats returns the round trips the server has made so far.
func (s *server) stats() int64 {
	resp, err := s.client.Get(s.url + "/stats")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	var n int64
	if _, err := fmt.Fscan(resp.Body, &n); err != nil {
		log.Fatal(err)
	}
	return n
}

// counter counts the round trips of the server's pool.
var counter roundtrip.Counter

// serve serves the payment route of mode (guarded, one, recipe or plain) on 127.0.0.1
// and prints its address; it exits when its standard input closes.
func serve(mode string) {
	stopProfile := profile(mode)
	go func() { // the benchmark has ended, or died
		io.Copy(io.Discard, os.Stdin)
		stopProfile()
		os.Exit(0)
	}()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	counter.Dial(cfg)
	if mode == "recipe" && os.Getenv("RECIPE_UNNAMED") == "on" {
		// as the middleware sends its own: unnamed, parsed and planned on every call (a transaction pooler's way)
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		amount numeric NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		log.Fatal(err)
	}
	if _, err = pool.Exec(ctx, recipeTable); err != nil {
		log.Fatal(err)
	}
	var payments http.Handler
	switch mode {
	case "guarded", "one", "guarded+prepare", "one+prepare":
		opts := idempotency.Options{OneTransaction: strings.HasPrefix(mode, "one"), Prepare: strings.HasSuffix(mode, "+prepare")}
		payments = idempotency.Middleware(pool, opts)(http.HandlerFunc(
			func(w http.ResponseWriter, r *http.Request) { charge(w, r, idempotency.Tx(r.Context())) }))
	case "recipe":
		payments = handWritten(pool, payment)
	default:
		payments = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, err := pool.Begin(r.Context())
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			defer tx.Rollback(context.Background())
			if charge(w, r, tx) {
				tx.Commit(r.Context())
			}
		})
	}
	mux := http.NewServeMux()
	mux.Handle("/payments", payments)
	mux.HandleFunc("/stats", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, counter.Count())
	})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(l.Addr())
	log.Fatal(http.Serve(l, mux))
}

// profile writes the CPU profile of the server of mode to
// $PROFILE_DIR/mode.pprof (go tool pprof reads it), when PROFILE_DIR is set;
// it returns what ends it.
func profile(mode string) func() {
	dir := os.Getenv("PROFILE_DIR")
	if dir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(dir, mode+".pprof"))
	if err != nil {
		log.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		log.Fatal(err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }
}

// charge inserts the request's charge through tx and answers 201 (400 for
// a bad amount, 500 when the insert fails); true when it charged.
func charge(w http.ResponseWriter, r *http.Request, tx pgx.Tx) bool {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return false
	}
	status, answer := payment(r.Context(), tx, body)
	respond(w, status, answer)
	return status == http.StatusCreated
}

// payment inserts the charge of body through tx; returns the answer's status and body.
func payment(ctx context.Context, tx pgx.Tx, body []byte) (int, []byte) {
	var p struct{ Amount float64 }
	if err := json.Unmarshal(body, &p); err != nil || p.Amount <= 0 {
		return http.StatusBadRequest, []byte(`{"error":"amount must be a positive number"}`)
	}
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO charges (amount) VALUES ($1) RETURNING id`, p.Amount).Scan(&id)
	if err != nil {
		return http.StatusInternalServerError, []byte(strconv.Quote(err.Error()))
	}
	return http.StatusCreated, []byte(fmt.Sprintf(`{"charge":%d}`, id))
}
