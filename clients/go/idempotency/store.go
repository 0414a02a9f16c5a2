package idempotency

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// store is the database side of the middleware, on pgx or on database/sql:
// autocommit calls (claim, release, a 5xx's complete) and the handler's
// transaction.
type store interface {
	Querier
	begin(ctx context.Context) (txn, error)
}

// txn is the handler's transaction.
type txn interface {
	Querier
	commit(ctx context.Context) error
	rollback(ctx context.Context) error
	handle() any // what Tx or SQLTx hands the handler
}

// pgxStore is a Pool (*pgxpool.Pool) as a store.
type pgxStore struct{ Pool }

// begin opens the handler's pgx transaction.
func (s pgxStore) begin(ctx context.Context) (txn, error) {
	tx, err := s.Begin(ctx)
	return pgxTxn{tx}, err
}

// pgxTxn is a pgx.Tx as a txn.
type pgxTxn struct{ pgx.Tx }

func (t pgxTxn) commit(ctx context.Context) error { return t.Commit(ctx) }

// rollback rolls back; one that has already ended is no error.
func (t pgxTxn) rollback(ctx context.Context) error {
	if err := t.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

func (t pgxTxn) handle() any { return t.Tx }

// sqlStore is a *sql.DB (on pgx's stdlib driver) as a store.
type sqlStore struct {
	Querier
	db *sql.DB
}

// begin opens the handler's database/sql transaction. database/sql rolls a
// transaction back when its context ends; the request's does when the
// client goes away, and what the handler finished must still commit.
func (s sqlStore) begin(ctx context.Context) (txn, error) {
	tx, err := s.db.BeginTx(context.WithoutCancel(ctx), nil)
	if err != nil {
		return nil, err
	}
	return sqlTxn{SQL(tx), tx}, nil
}

// sqlTxn is a *sql.Tx as a txn.
type sqlTxn struct {
	Querier
	tx *sql.Tx
}

func (t sqlTxn) commit(context.Context) error { return t.tx.Commit() }

// rollback rolls back; one that has already ended is no error.
func (t sqlTxn) rollback(context.Context) error {
	if err := t.tx.Rollback(); !errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return nil
}

func (t sqlTxn) handle() any { return t.tx }

// SQLQuerier is what SQL needs: *sql.DB, *sql.Conn and *sql.Tx all are one.
type SQLQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// SQL makes a database/sql handle on pgx's stdlib driver
// (github.com/jackc/pgx/v5/stdlib) a Querier, for Claim, Lookup and the
// Ticket's calls.
func SQL(db SQLQuerier) Querier { return sqlQuerier{db} }

type sqlQuerier struct{ db SQLQuerier }

// Exec runs a statement; the command tag is not kept.
func (q sqlQuerier) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	_, err := q.db.ExecContext(ctx, query, args...)
	return pgconn.CommandTag{}, err
}

// QueryRow runs a query of one row; sql.ErrNoRows reads as pgx.ErrNoRows.
func (q sqlQuerier) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	return sqlRow{q.db.QueryRowContext(ctx, query, args...)}
}

type sqlRow struct{ *sql.Row }

// Scan reads the row; no row is pgx.ErrNoRows, as Lookup expects.
func (r sqlRow) Scan(dest ...any) error {
	if err := r.Row.Scan(dest...); !errors.Is(err, sql.ErrNoRows) {
		return err
	}
	return pgx.ErrNoRows
}
