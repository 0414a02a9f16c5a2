package idempotency

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// faultProxy is the repository's fault-injecting proxy
// (examples/faultproxy) between a pool and DATABASE_URL's server.
type faultProxy struct {
	control string        // the base URL of its control interface
	pool    *pgxpool.Pool // a pool whose connections go through it
}

// startFaultProxy starts examples/faultproxy/faultproxy.js (FAULTPROXY names
// another copy) on node; skips t when either is missing.
func startFaultProxy(t *testing.T) *faultProxy {
	script := os.Getenv("FAULTPROXY")
	if script == "" {
		script = filepath.Join("..", "..", "..", "examples", "faultproxy", "faultproxy.js")
	}
	node, err := exec.LookPath("node")
	if _, serr := os.Stat(script); serr != nil || err != nil {
		t.Skipf("no fault proxy: %s or node missing", script)
	}
	cfg := pool.Config()
	target := fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	cmd := exec.Command(node, script, "--target", target)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var ports struct{ Listen, Control int }
	line, err := bufio.NewReader(out).ReadBytes('\n')
	if err != nil || json.Unmarshal(line, &ports) != nil {
		t.Fatalf("fault proxy said %q (%v)", line, err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(ports.Listen)
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return &faultProxy{control: fmt.Sprintf("http://127.0.0.1:%d", ports.Control), pool: p}
}

// do sends a command (POST) to the proxy.
func (f *faultProxy) do(t *testing.T, command string) {
	t.Helper()
	resp, err := http.Post(f.control+command, "", nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("fault proxy %s: %v %v", command, resp, err)
	}
	resp.Body.Close()
}

// stats reads the proxy's counters.
func (f *faultProxy) stats(t *testing.T) map[string]any {
	t.Helper()
	resp, err := http.Get(f.control + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var s map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// Over a real connection, cut by the proxy once the server has answered:
// the claim's answer, then the COMMIT's (of the transaction with complete),
// then every connection dropped and the next new ones refused. Each time
// the handler runs once, its answer reaches the client, the record ends
// completed, and the retry replays.
func TestFaultProxy(t *testing.T) {
	f := startFaultProxy(t)
	faults := []struct{ name, command string }{
		{"claim's answer lost", "/cut?match=idempotency%5C.claim&scope=statement"},
		{"COMMIT's answer lost", "/cut?match=idempotency%5C.complete&scope=transaction"},
		{"connections dropped and refused", "/drop"},
	}
	for _, fault := range faults {
		t.Run(fault.name, func(t *testing.T) {
			var runs int32
			srv := serve(t, f.pool, Options{}, charge(&runs))
			c := keyed(uniqueKey(t), `{}`)
			if r := send(t, srv, c); r.status != 201 { // a connection in the pool
				t.Fatalf("before the fault: %d %s", r.status, r.body)
			}
			c = keyed(uniqueKey(t), `{}`)
			f.do(t, "/reset")
			f.do(t, fault.command)
			if fault.command == "/drop" {
				f.do(t, "/refuse?count=2")
			}
			r := send(t, srv, c)
			if r.status != 201 || r.header.Get("X-Trace") != "2" || runs != 2 {
				t.Fatalf("%d %v %s after %d runs; want the handler's 201, run 2", r.status, r.header, r.body, runs)
			}
			s := f.stats(t)
			if s["cuts"].(float64)+s["dropped"].(float64) < 1 {
				t.Fatalf("the fault did not happen: %v", s)
			}
			wantCompletedOnce(t, c.header["X-Key"])
			if again := send(t, srv, c); again.header.Get("Idempotent-Replayed") != "true" || runs != 2 {
				t.Fatalf("the retry: %d %v after %d runs", again.status, again.header, runs)
			}
		})
	}
}
