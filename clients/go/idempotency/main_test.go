package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"testing"

	"database/sql"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql's "pgx"
)

// oneTransaction runs the middleware's tests with Options.OneTransaction
// (IDEMPOTENCY_ONE_TRANSACTION=on; clients/go/test runs them both ways).
var oneTransaction = os.Getenv("IDEMPOTENCY_ONE_TRANSACTION") == "on"

// prepareAll runs the middleware's tests on pgx with its statements
// prepared (IDEMPOTENCY_PREPARE=on; clients/go/test runs the one-transaction
// pass so).
var prepareAll = os.Getenv("IDEMPOTENCY_PREPARE") == "on"

// pool is a pool on DATABASE_URL, a database with the extension; sqlDB is
// the same database through database/sql.
var (
	pool  *pgxpool.Pool
	sqlDB *sql.DB
)

// TestMain connects to DATABASE_URL: every test but the parsers needs it.
func TestMain(m *testing.M) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		fmt.Fprintln(os.Stderr, "DATABASE_URL must name a database where CREATE EXTENSION idempotency is done")
		os.Exit(1)
	}
	var err error
	if pool, err = pgxpool.New(context.Background(), url); err != nil {
		fmt.Fprintln(os.Stderr, "cannot connect to DATABASE_URL:", err)
		os.Exit(1)
	}
	if sqlDB, err = sql.Open("pgx", url); err != nil {
		fmt.Fprintln(os.Stderr, "cannot open DATABASE_URL with database/sql:", err)
		os.Exit(1)
	}
	// writes: the handlers' business rows; deferred: a second row of one
	// value fails at COMMIT.
	_, err = pool.Exec(context.Background(), `DROP TABLE IF EXISTS writes, deferred;
		CREATE TABLE writes (key text, attempt int);
		CREATE TABLE deferred (v text UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cannot create the test tables:", err)
		os.Exit(1)
	}
	code := m.Run()
	pool.Close()
	sqlDB.Close()
	os.Exit(code)
}

// uniqueKey returns a key no other test or run uses.
func uniqueKey(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return t.Name() + "-" + hex.EncodeToString(b)
}
