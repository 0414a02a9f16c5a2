package main

// The hand-written recipe, with no idempotency library: what a careful team
// writes with pgx before it reaches for one, the yardstick of this
// benchmark. In one transaction, INSERT ... ON CONFLICT DO NOTHING claims
// (scope, key) in a table of its own; when it inserted, the route's work and
// the UPDATE that stores the response; when it did not (the key committed
// before, or a concurrent duplicate waited on the unique index until it
// did), the SELECT of the stored response: replayed when the request hash is
// the same, else 422. Scoped per caller (a hash of the credential). An error
// or a 5xx rolls the claim back with the work, so that a retry runs again;
// so does a crash.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	recipeTable = `CREATE TABLE IF NOT EXISTS recipe_keys (
		scope text NOT NULL, key text NOT NULL, request_hash bytea NOT NULL,
		status text NOT NULL DEFAULT 'started', response_code int, response_body bytea,
		created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))`
	recipeClaim  = `INSERT INTO recipe_keys (scope, key, request_hash) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`
	recipeStored = `SELECT request_hash, status, response_code, response_body FROM recipe_keys WHERE scope = $1 AND key = $2`
	recipeStore  = `UPDATE recipe_keys SET status = 'completed', response_code = $3, response_body = $4
		WHERE scope = $1 AND key = $2`
)

// work is a route's work in the request's transaction: it returns the answer's status and JSON body.
type work func(ctx context.Context, tx pgx.Tx, body []byte) (int, []byte)

// handWritten returns a handler that runs do under the recipe.
func handWritten(pool *pgxpool.Pool, do work) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		body, err := io.ReadAll(r.Body)
		if key == "" || len(key) > 255 || err != nil {
			http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
			return
		}
		credential := sha256.Sum256([]byte(r.Header.Get("Authorization")))
		scope := hex.EncodeToString(credential[:])
		hash := sha256.New()
		io.WriteString(hash, r.Method+" "+r.URL.Path+"\n")
		hash.Write(body)
		requestHash := hash.Sum(nil)
		ctx := r.Context()
		tx, err := pool.Begin(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback(context.Background())
		claimed, err := tx.Exec(ctx, recipeClaim, scope, key, requestHash)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if claimed.RowsAffected() == 0 {
			replay(w, ctx, tx, scope, key, requestHash)
			return
		}
		status, answer := do(ctx, tx, body)
		if status < 500 {
			if _, err := tx.Exec(ctx, recipeStore, scope, key, status, answer); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if err := tx.Commit(ctx); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		respond(w, status, answer)
	})
}

// replay answers a key that was there: its stored response, or 422 for another request, 409 in progress.
func replay(w http.ResponseWriter, ctx context.Context, tx pgx.Tx, scope, key string, requestHash []byte) {
	var storedHash, stored []byte
	var state string
	var code *int32
	err := tx.QueryRow(ctx, recipeStored, scope, key).Scan(&storedHash, &state, &code, &stored)
	if err == nil {
		err = tx.Commit(ctx)
	}
	switch {
	case err != nil:
		http.Error(w, err.Error(), http.StatusInternalServerError)
	case !bytes.Equal(storedHash, requestHash):
		http.Error(w, "key reused", http.StatusUnprocessableEntity)
	case state != "completed" || code == nil:
		http.Error(w, "in progress", http.StatusConflict)
	default:
		w.Header().Set("Idempotent-Replayed", "true")
		respond(w, int(*code), stored)
	}
}

// respond writes a JSON answer.
func respond(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}
