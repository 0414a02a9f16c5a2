package idempotency

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idempotency/idempotency/clients/go/internal/roundtrip"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The package through pgbouncer in transaction mode, with pgx's default
// settings (QueryExecModeCacheStatement): every transaction, and every
// statement outside one, may run on another server connection, where a
// named prepared statement of pgx's does not exist (26000), exists with
// another text (42P05), or binds this client's parameters to another
// client's statement. PGBOUNCER names the binary (default Debian's
// /usr/sbin/pgbouncer); the tests skip, saying why, without it.

// startBouncer starts pgbouncer in transaction mode (nothing else changed)
// on 127.0.0.1 before DATABASE_URL's server and returns a URL through it.
func startBouncer(t *testing.T) string {
	binary := os.Getenv("PGBOUNCER")
	if binary == "" {
		binary = "/usr/sbin/pgbouncer"
	}
	if _, err := os.Stat(binary); err != nil {
		t.Skipf("no pgbouncer at %s (Debian: apt-get install pgbouncer)", binary)
	}
	cc := pool.Config().ConnConfig
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil { // read by pgbouncer as nobody
		t.Fatal(err)
	}
	port := freePort(t)
	ini := filepath.Join(dir, "pgbouncer.ini")
	users := filepath.Join(dir, "users.txt")
	config := fmt.Sprintf(`[databases]
* = host=%s port=%d
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
`, cc.Host, cc.Port, port, users)
	if err := os.WriteFile(users, fmt.Appendf(nil, "%q \"\"\n", cc.User), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ini, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{ini}
	if os.Geteuid() == 0 { // pgbouncer refuses to run as root
		args = append([]string{"-u", "nobody"}, args...)
	}
	cmd := exec.Command(binary, args...)
	var log bytes.Buffer // shown when the test fails
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("pgbouncer's log:\n%s", log.Bytes())
		}
	})
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("pgbouncer did not start")
		}
	}
	return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cc.User, addr, cc.Database)
}

// freePort returns a TCP port of 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// hog is a client of pgbouncer that takes the server connection used last
// (pgbouncer hands them out last in, first out) and keeps it in an open
// transaction, so that the next transaction of the pool under test runs
// on another server connection than its previous one did.
type hog struct{ conn *pgx.Conn }

// newHog connects to url.
func newHog(t *testing.T, url string) *hog {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	return &hog{conn}
}

// toggle takes the server connection used last, or gives back the one it
// holds.
func (h *hog) toggle(t *testing.T) {
	t.Helper()
	sql := "BEGIN; SELECT 1"
	if h.conn.PgConn().TxStatus() == 'T' {
		sql = "ROLLBACK"
	}
	if _, err := h.conn.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
}

// bouncedPool is a pgxpool with pgx's default settings through url; with
// counter, its round trips are counted.
func bouncedPool(t *testing.T, url string, counter *roundtrip.Counter) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	if counter != nil {
		counter.Dial(cfg)
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// Claim, Complete, Release and Lookup on a pool through pgbouncer, each
// call on another server connection than the one before.
func TestPgbouncerClient(t *testing.T) {
	url := startBouncer(t)
	db, h := bouncedPool(t, url, nil), newHog(t, url)
	key := uniqueKey(t)
	for i := range 8 {
		p := ClaimParams{Key: fmt.Sprint(key, i), Fingerprint: fp("1"), Token: NewToken()}
		ticket, err := Claim(ctx, db, p)
		if err != nil || ticket.Outcome != New {
			t.Fatalf("claim %d: %+v %v", i, ticket, err)
		}
		h.toggle(t)
		if i%2 == 1 {
			if ok, err := ticket.Release(ctx, db); err != nil || !ok {
				t.Fatalf("release %d: %v %v", i, ok, err)
			}
			continue
		}
		if _, err := ticket.Complete(ctx, db, 201, []byte("ok"), nil); err != nil {
			t.Fatalf("complete %d: %v", i, err)
		}
		h.toggle(t)
		if again, err := Claim(ctx, db, p); err != nil || again.Outcome != Replay || string(again.Body) != "ok" {
			t.Fatalf("replay %d: %+v %v", i, again, err)
		}
		h.toggle(t)
		if r, err := Lookup(ctx, db, "", p.Key); err != nil || r == nil || r.State != "completed" {
			t.Fatalf("lookup %d: %+v %v", i, r, err)
		}
	}
}

// insertBounced is a handler: a row for the X-Key header's key through the
// request's transaction, then 201. Its own statement is unnamed
// (pgx.QueryExecModeExec), as an app's must be through pgbouncer before 1.21.
func insertBounced(w http.ResponseWriter, r *http.Request) {
	_, err := Tx(r.Context()).Exec(r.Context(), `INSERT INTO writes VALUES ($1, 1)`,
		pgx.QueryExecModeExec, r.Header.Get("X-Key"))
	if err != nil {
		http.Error(w, err.Error(), 500)
		return
	}
	w.WriteHeader(201)
	fmt.Fprint(w, r.Header.Get("X-Key"))
}

// The middleware through pgbouncer, in both modes: fresh keys and their
// replays, each request on another server connection than the one before
// and in the round trips of TestRoundTrips, then concurrent duplicates of
// one key.
func TestPgbouncerMiddleware(t *testing.T) {
	url := startBouncer(t)
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			var counter roundtrip.Counter
			db, h := bouncedPool(t, url, &counter), newHog(t, url)
			srv := serveMode(t, db, one, Options{}, insertBounced)
			want := map[bool][2]int64{false: {4, 1}, true: {3, 2}}[one] // fresh, replay
			for i := range 6 {
				c := keyed(fmt.Sprint(uniqueKey(t), i), `{}`)
				before := counter.Count()
				first := send(t, srv, c)
				fresh := counter.Count() - before
				h.toggle(t)
				before = counter.Count()
				again := send(t, srv, c)
				waitIdle(t, db) // one transaction: the replay's ROLLBACK may follow its answer
				trips := [2]int64{fresh, counter.Count() - before}
				h.toggle(t)
				if i > 0 && trips != want { // the first request also connects
					t.Errorf("request %d: round trips (fresh, replay) %v, want %v", i, trips, want)
				}
				if first.status != 201 || first.header.Get("Idempotent-Replayed") != "" ||
					again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" ||
					string(again.body) != string(first.body) || writesOf(t, c.header["X-Key"]) != 1 {
					t.Fatalf("request %d: %d %q, then %d %v %q", i, first.status, first.body,
						again.status, again.header, again.body)
				}
			}
			c := keyed(uniqueKey(t), `{}`)
			replies := make(chan reply, 8)
			var wg sync.WaitGroup
			for range cap(replies) {
				wg.Go(func() { replies <- send(t, srv, c) })
			}
			wg.Wait()
			close(replies)
			fresh := 0
			for r := range replies {
				switch {
				case r.status == 201 && r.header.Get("Idempotent-Replayed") == "":
					fresh++
				case r.status == 201 || r.status == 409:
				default:
					t.Errorf("a duplicate got %d %s", r.status, r.body)
				}
			}
			if fresh != 1 || writesOf(t, c.header["X-Key"]) != 1 {
				t.Fatalf("%d fresh answers, %d writes; want 1 and 1", fresh, writesOf(t, c.header["X-Key"]))
			}
		})
	}
}
