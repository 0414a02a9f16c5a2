package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// store is the database side of the middleware, on pgx or on database/sql:
// autocommit calls (claim, release, a 5xx's complete) and the handler's
// transaction.
type store interface {
	Querier
	begin(ctx context.Context) (txn, error)
	// beginClaim begins a transaction and claims p in it.
	beginClaim(ctx context.Context, p ClaimParams) (txn, *Ticket, error)
}

// txn is the handler's transaction.
type txn interface {
	// finish runs complete (c, unless nil) and commits.
	finish(ctx context.Context, c *completion) error
	rollback(ctx context.Context) error
	handle() any // what Tx or SQLTx hands the handler
	cut() bool   // whether the deadline of a context the handler used on it passed
}

// completion is what complete stores for a ticket, and what it answered.
type completion struct {
	ticket *Ticket
	status int
	body   []byte
	header http.Header
	result string // Stored or Released, once finish has run complete
}

// pgxStore is a Pool (*pgxpool.Pool) as a store: BEGIN travels with the
// claim, and complete with COMMIT, each pair in one batch. With prepare,
// the statements of the package go prepared on each connection.
type pgxStore struct {
	Pool
	prepare bool
}

// QueryRow runs a query of one row on a connection of the pool; with
// prepare, as a statement prepared on that connection, once more on another
// connection when that one had lost it.
func (s pgxStore) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !s.prepare {
		return s.Pool.QueryRow(ctx, sql, args...)
	}
	return rowFunc(func(dest ...any) error {
		err := s.queryPrepared(ctx, sql, args, dest)
		if SQLState(err) == "26000" {
			err = s.queryPrepared(ctx, sql, args, dest)
		}
		return err
	})
}

// queryPrepared runs sql prepared on a connection of the pool and scans its
// row into dest.
func (s pgxStore) queryPrepared(ctx context.Context, sql string, args, dest []any) error {
	conn, err := s.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := prepared(ctx, conn.Conn(), sql); err != nil {
		return err
	}
	err = conn.QueryRow(ctx, sql, args...).Scan(dest...)
	closeIfStale(ctx, conn.Conn(), err)
	return err
}

// begin opens the handler's transaction on a connection of the pool.
func (s pgxStore) begin(ctx context.Context) (txn, error) {
	tx, _, err := beginTx(ctx, s.Pool, nil, s.prepare)
	if err != nil {
		return nil, err
	}
	return tx, nil
}

// beginClaim sends BEGIN and the claim in one batch.
func (s pgxStore) beginClaim(ctx context.Context, p ClaimParams) (txn, *Ticket, error) {
	tx, t, err := beginTx(ctx, s.Pool, &p, s.prepare)
	if err != nil {
		return nil, nil, err
	}
	return tx, t, nil
}

func (t *connTx) handle() any { return pgx.Tx(t) }

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

// beginClaim begins and claims in the transaction: two round trips, as
// database/sql has no batches.
func (s sqlStore) beginClaim(ctx context.Context, p ClaimParams) (txn, *Ticket, error) {
	tx, err := s.begin(ctx)
	if err != nil {
		return nil, nil, err
	}
	t, err := claimOn(ctx, tx.(sqlTxn), p)
	if err != nil {
		tx.rollback(context.WithoutCancel(ctx))
		return nil, nil, err
	}
	return tx, t, nil
}

// sqlTxn is a *sql.Tx as a txn.
type sqlTxn struct {
	Querier
	tx *sql.Tx
}

// finish runs complete, then COMMIT: database/sql sends each on its own.
func (t sqlTxn) finish(ctx context.Context, c *completion) error {
	if c != nil {
		var err error
		if c.result, err = c.ticket.complete(ctx, t, c.status, c.body, c.header); err != nil {
			return err
		}
	}
	return t.tx.Commit()
}

// rollback rolls back; one that has already ended is no error.
func (t sqlTxn) rollback(context.Context) error {
	if err := t.tx.Rollback(); !errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return nil
}

func (t sqlTxn) handle() any { return t.tx }

// cut is false: the handler's contexts are not seen through database/sql.
func (t sqlTxn) cut() bool { return false }

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
