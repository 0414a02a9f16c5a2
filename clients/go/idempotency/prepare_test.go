package idempotency

import (
	"context"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// preparedCalls returns, per statement of the package prepared on the one
// connection of db, how many times the server has planned it.
func preparedCalls(t *testing.T, db *pgxpool.Pool) map[string]int64 {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%idempotency.%'`, pgx.QueryExecModeExec) // itself unnamed
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int64{}
	for rows.Next() {
		var sql string
		var n int64
		if err := rows.Scan(&sql, &n); err != nil {
			t.Fatal(err)
		}
		calls[sql] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return calls
}

// With Prepare (and RunOptions.Prepare), the claim and complete are
// prepared once on the connection and run again from it, in both modes; without, nothing of the package is
// prepared there. When the server has dropped them (DEALLOCATE), the
// request runs on another connection, where they are prepared again.
func TestPrepare(t *testing.T) {
	for name, one := range modes {
		t.Run(name, func(t *testing.T) {
			for _, prepare := range []bool{false, true} {
				db, _ := countedPool(t) // one connection, so the queries below see the middleware's
				var runs int32
				srv := serveGuarded(t, pgxStore{Pool: db, prepare: prepare},
					Options{OneTransaction: one, Prepare: prepare}, charge(&runs))
				for i := 0; i < 3; i++ {
					c := keyed(uniqueKey(t), `{}`)
					if r := send(t, srv, c); r.status != http.StatusCreated {
						t.Fatalf("fresh: %d %s", r.status, r.body)
					}
					if r := send(t, srv, c); r.header.Get("Idempotent-Replayed") != "true" {
						t.Fatalf("replay: %d %s", r.status, r.body)
					}
				}
				work := Work{Scope: "prepare", Key: uniqueKey(t), Args: 1}
				_, err := Run(ctx, db, work, func(context.Context, pgx.Tx) (int, error) { return 1, nil },
					RunOptions{TwoTransactions: !one, Prepare: prepare})
				if err != nil {
					t.Fatal(err)
				}
				calls := preparedCalls(t, db)
				if !prepare {
					if len(calls) != 0 {
						t.Fatalf("without Prepare, prepared: %v", calls)
					}
					continue
				}
				if calls[claimSQL] != 7 || calls[completeSQL] != 4 || len(calls) != 2 {
					t.Fatalf("prepared statements and their runs: %v; want the claim 7, complete 4", calls)
				}
				var names string // the handler's own statements are pgx's affair
				err = db.QueryRow(ctx, `SELECT string_agg('DEALLOCATE ' || quote_ident(name), '; ')
					FROM pg_prepared_statements WHERE statement LIKE '%idempotency.%'`, pgx.QueryExecModeExec).Scan(&names)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := db.Exec(ctx, names, pgx.QueryExecModeSimpleProtocol); err != nil {
					t.Fatal(err)
				}
				c := keyed(uniqueKey(t), `{}`)
				if r := send(t, srv, c); r.status != http.StatusCreated {
					t.Fatalf("after DEALLOCATE: %d %s", r.status, r.body)
				}
				if calls := preparedCalls(t, db); calls[claimSQL] == 0 || calls[completeSQL] == 0 {
					t.Fatalf("after DEALLOCATE, prepared: %v", calls)
				}
			}
		})
	}
}
