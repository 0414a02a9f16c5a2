package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// errNotYours is what the handler (or Run's function) gets when it commits
// or rolls back the transaction: the middleware (or Run) ends it, with the
// response (the result).
var errNotYours = errors.New("idempotency: the middleware (or Run) commits or rolls back this transaction; " +
	"answer 5xx (return an error) to roll it back")

// connTx is the handler's transaction on a pooled connection, a pgx.Tx of
// the middleware's own (pgx makes its own only by sending BEGIN on its own):
// so its BEGIN can travel with the claim and its COMMIT with complete, each
// in one pgx batch. Once the middleware has ended it, the calls of a handler
// that is still running (behind http.TimeoutHandler) get pgx.ErrTxClosed;
// mu keeps them from using the connection at the same time as the middleware.
type connTx struct {
	mu         sync.Mutex
	conn       *pgxpool.Conn
	ended      bool              // committed or rolled back, and the connection given back
	contexts   []context.Context // the contexts the handler used on it (the first few)
	savepoints int64             // how many Begin made
	prepare    bool              // the middleware's statements go prepared (Options.Prepare)
}

// maxContexts bounds the contexts a transaction keeps.
const maxContexts = 8

// use runs f on the connection unless the transaction has ended, and keeps
// ctx for cut.
func (t *connTx) use(ctx context.Context, f func(*pgx.Conn) error) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return pgx.ErrTxClosed
	}
	if n := len(t.contexts); n < maxContexts && (n == 0 || t.contexts[n-1] != ctx) {
		t.contexts = append(t.contexts, ctx)
	}
	return f(t.conn.Conn())
}

// Exec runs a statement in the transaction.
func (t *connTx) Exec(ctx context.Context, sql string, args ...any) (tag pgconn.CommandTag, err error) {
	err = t.use(ctx, func(c *pgx.Conn) error { tag, err = c.Exec(ctx, sql, args...); return err })
	return tag, err
}

// Query runs a query in the transaction. Read its rows before the handler
// returns.
func (t *connTx) Query(ctx context.Context, sql string, args ...any) (rows pgx.Rows, err error) {
	err = t.use(ctx, func(c *pgx.Conn) error { rows, err = c.Query(ctx, sql, args...); return err })
	if rows == nil {
		rows = errRows{err}
	}
	return rows, err
}

// QueryRow runs a query of one row in the transaction; its Scan reads it.
func (t *connTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return rowFunc(func(dest ...any) error {
		return t.use(ctx, func(c *pgx.Conn) error { return c.QueryRow(ctx, sql, args...).Scan(dest...) })
	})
}

// SendBatch sends b in the transaction. Close its results before the
// handler returns.
func (t *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	var results pgx.BatchResults
	err := t.use(ctx, func(c *pgx.Conn) error { results = c.SendBatch(ctx, b); return nil })
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return results
}

// CopyFrom copies rows into a table in the transaction.
func (t *connTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (n int64, err error) {
	err = t.use(ctx, func(c *pgx.Conn) error { n, err = c.CopyFrom(ctx, table, columns, src); return err })
	return n, err
}

// Prepare prepares a statement on the connection.
func (t *connTx) Prepare(ctx context.Context, name, sql string) (sd *pgconn.StatementDescription, err error) {
	err = t.use(ctx, func(c *pgx.Conn) error { sd, err = c.Prepare(ctx, name, sql); return err })
	return sd, err
}

// LargeObjects gives pgx's large objects in the transaction: they need a
// pgx.Tx of pgx's, which is made (by a statement that does nothing) on
// first use.
func (t *connTx) LargeObjects() pgx.LargeObjects {
	var tx pgx.Tx
	t.use(context.Background(), func(c *pgx.Conn) (err error) {
		tx, err = c.BeginTx(context.Background(), pgx.TxOptions{BeginQuery: "SELECT"})
		return err
	})
	if tx == nil {
		return pgx.LargeObjects{}
	}
	return tx.LargeObjects()
}

// Conn is the connection the transaction runs on.
func (t *connTx) Conn() *pgx.Conn { return t.conn.Conn() }

// Commit is the middleware's: the handler gets errNotYours.
func (t *connTx) Commit(context.Context) error { return errNotYours }

// Rollback is the middleware's: the handler gets errNotYours.
func (t *connTx) Rollback(context.Context) error { return errNotYours }

// Begin starts a pseudo nested transaction (a savepoint), as pgx's do.
func (t *connTx) Begin(ctx context.Context) (pgx.Tx, error) {
	t.mu.Lock()
	t.savepoints++
	name := fmt.Sprintf("idempotency_sp_%d", t.savepoints)
	t.mu.Unlock()
	if _, err := t.Exec(ctx, "SAVEPOINT "+name); err != nil {
		return nil, err
	}
	return &savepoint{connTx: t, name: name}, nil
}

// savepoint is a pseudo nested transaction of the handler's.
type savepoint struct {
	*connTx
	name   string
	closed bool
}

// Commit releases the savepoint.
func (s *savepoint) Commit(ctx context.Context) error {
	return s.end(ctx, "RELEASE SAVEPOINT ")
}

// Rollback rolls back to the savepoint; once ended, it does nothing.
func (s *savepoint) Rollback(ctx context.Context) error {
	return s.end(ctx, "ROLLBACK TO SAVEPOINT ")
}

// end runs how+name once.
func (s *savepoint) end(ctx context.Context, how string) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	s.closed = true
	_, err := s.connTx.Exec(ctx, how+s.name)
	return err
}

// beginTx acquires a connection and begins a transaction on it; with p, the
// claim travels in the same batch (one round trip), inside the transaction.
func beginTx(ctx context.Context, pool Pool, p *ClaimParams, prepare bool) (*connTx, *Ticket, error) {
	tx, ticket, err := beginOn(ctx, pool, p, prepare)
	if prepare && SQLState(err) == "26000" { // that connection lost its statements and is closed: once more
		tx, ticket, err = beginOn(ctx, pool, p, prepare)
	}
	return tx, ticket, err
}

// beginOn is beginTx, once.
func beginOn(ctx context.Context, pool Pool, p *ClaimParams, prepare bool) (*connTx, *Ticket, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	t := &connTx{conn: conn, prepare: prepare}
	stmts := []statement{{sql: "BEGIN"}}
	var ticket *Ticket
	if p != nil {
		stmts = append(stmts, statement{sql: claimSQL, args: claimArgs(*p),
			read: func(row pgx.Row, _ pgconn.CommandTag) (err error) {
				ticket, err = scanTicket(row, *p)
				return err
			}})
	}
	if err := sendBatch(ctx, conn.Conn(), prepare, stmts...); err != nil {
		t.rollback(context.WithoutCancel(ctx))
		return nil, nil, err
	}
	return t, ticket, nil
}

// finish stores the response with complete (c, when claimed) and commits,
// both in one batch: one round trip. A failed complete leaves the
// transaction to roll back; the connection goes back to the pool once the
// transaction has ended.
func (t *connTx) finish(ctx context.Context, c *completion) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return pgx.ErrTxClosed
	}
	var stmts []statement
	if c != nil {
		args, err := c.ticket.completeArgs(c.status, c.body, c.header)
		if err != nil {
			return err
		}
		stmts = append(stmts, statement{sql: completeSQL, args: args,
			read: func(row pgx.Row, _ pgconn.CommandTag) error {
				if err := row.Scan(&c.result); err != nil {
					return c.ticket.wrap("complete", err)
				}
				return nil
			}})
	}
	stmts = append(stmts, statement{sql: "COMMIT", read: func(_ pgx.Row, tag pgconn.CommandTag) error {
		if tag.String() == "ROLLBACK" { // the transaction had failed
			return pgx.ErrTxCommitRollback
		}
		return nil
	}})
	err := sendBatch(ctx, t.conn.Conn(), t.prepare, stmts...)
	if pg := t.conn.Conn().PgConn(); err == nil || pg.IsClosed() || pg.TxStatus() == 'I' {
		t.ended = true
		t.conn.Release()
	}
	return err
}

// commitWith runs sql with args, then COMMIT and BEGIN, in one round trip:
// the writes so far commit with it, and the transaction goes on as a new
// one on the same connection. When sql fails, nothing is committed and the
// transaction is left failed.
func (t *connTx) commitWith(ctx context.Context, sql string, args []any) error {
	return t.use(ctx, func(c *pgx.Conn) error {
		return sendBatch(ctx, c, t.prepare, statement{sql: sql, args: args}, statement{sql: "COMMIT"}, statement{sql: "BEGIN"})
	})
}

// statement is one statement of sendBatch, and what reads its answer.
type statement struct {
	sql  string
	args []any
	// read gets the first row (pgx.ErrNoRows when none) and the command
	// tag, or the batch's error as the row's (then the batch's error is
	// returned unless read returns its own); nil: not read.
	read func(row pgx.Row, tag pgconn.CommandTag) error
}

// sendBatch sends stmts in one round trip. Unless prepare, each goes as an
// unnamed statement with its arguments as text, as pgx's QueryExecModeExec
// does: pgx's batches take the connection's DefaultQueryExecMode, whose
// default names prepared statements that a transaction pooler before
// pgbouncer 1.21 does not keep (see unnamed). With prepare, each statement
// with arguments is prepared once on the connection (see prepared) and
// only bound and executed. The pool's pgx.BatchTracer (otelpgx, say) sees
// it as it would see a pgx batch. Returns the first error of a read, or
// the batch's.
func sendBatch(ctx context.Context, conn *pgx.Conn, prepare bool, stmts ...statement) error {
	var eqb pgx.ExtendedQueryBuilder
	batch := &pgconn.Batch{}
	for _, s := range stmts {
		if !prepare || s.args == nil {
			if err := eqb.Build(conn.TypeMap(), nil, s.args); err != nil {
				return err
			}
			batch.ExecParams(s.sql, eqb.ParamValues, nil, eqb.ParamFormats, eqb.ResultFormats)
			continue
		}
		sd, err := prepared(ctx, conn, s.sql)
		if err != nil {
			return err
		}
		if err := eqb.Build(conn.TypeMap(), sd, s.args); err != nil {
			return err
		}
		batch.ExecStatement(sd, eqb.ParamValues, eqb.ParamFormats, eqb.ResultFormats)
	}
	ctx, done := traceBatch(ctx, conn, stmts)
	results, err := conn.PgConn().ExecBatch(ctx, batch).ReadAll()
	done(results, err)
	if prepare && err != nil {
		closeIfStale(ctx, conn, err)
	}
	for i, s := range stmts {
		if s.read == nil {
			continue
		}
		if i >= len(results) || results[i].Err != nil {
			if rerr := s.read(errRow{err}, pgconn.CommandTag{}); rerr != nil {
				return rerr
			}
			return err
		}
		r := results[i]
		row := rowFunc(func(dest ...any) error {
			if len(r.Rows) == 0 {
				return pgx.ErrNoRows
			}
			return pgx.ScanRow(conn.TypeMap(), r.FieldDescriptions, r.Rows[0], dest...)
		})
		if rerr := s.read(row, r.CommandTag); rerr != nil {
			return rerr
		}
	}
	return err
}

// prepared returns sql prepared on conn, preparing it (one round trip) the
// first time. pgx keeps it by its text: conn's Query, QueryRow and Exec of
// that text use it too, whatever their QueryExecMode.
func prepared(ctx context.Context, conn *pgx.Conn, sql string) (*pgconn.StatementDescription, error) {
	return conn.Prepare(ctx, sql, sql)
}

// closeIfStale closes conn when err says that the server lost a statement
// prepared on it (26000: DEALLOCATE or DISCARD ALL, a pooler that moved the
// session) or can no longer run it (0A000: its result type changed): pgx
// would go on using it, and the server may have lost the others too. The
// pool replaces a closed connection. True when it closed conn.
func closeIfStale(ctx context.Context, conn *pgx.Conn, err error) bool {
	if code := SQLState(err); code != "26000" && code != "0A000" {
		return false
	}
	conn.Close(context.WithoutCancel(ctx))
	return true
}

// traceBatch tells the connection's pgx.BatchTracer, if any, that stmts
// are sent; done tells it their results.
func traceBatch(ctx context.Context, conn *pgx.Conn, stmts []statement) (context.Context, func([]*pgconn.Result, error)) {
	tracer, ok := conn.Config().Tracer.(pgx.BatchTracer)
	if !ok {
		return ctx, func([]*pgconn.Result, error) {}
	}
	b := &pgx.Batch{}
	for _, s := range stmts {
		b.Queue(s.sql, s.args...)
	}
	ctx = tracer.TraceBatchStart(ctx, conn, pgx.TraceBatchStartData{Batch: b})
	return ctx, func(results []*pgconn.Result, err error) {
		for i, r := range results {
			tracer.TraceBatchQuery(ctx, conn, pgx.TraceBatchQueryData{SQL: stmts[i].sql, Args: stmts[i].args,
				CommandTag: r.CommandTag, Err: r.Err})
		}
		tracer.TraceBatchEnd(ctx, conn, pgx.TraceBatchEndData{Err: err})
	}
}

// rollback rolls back, unless the transaction has ended, and gives the
// connection back (the pool closes one that is not idle).
func (t *connTx) rollback(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return nil
	}
	t.ended = true
	defer t.conn.Release()
	if pg := t.conn.Conn().PgConn(); pg.IsClosed() || pg.TxStatus() == 'I' {
		return nil
	}
	_, err := t.conn.Exec(ctx, "ROLLBACK")
	return err
}

// cut reports whether the deadline of a context the handler used on the
// transaction has passed (http.TimeoutHandler's, when it answered 503).
func (t *connTx) cut() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ctx := range t.contexts {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return true
		}
	}
	return false
}

// rowFunc is a pgx.Row whose Scan is the function.
type rowFunc func(dest ...any) error

func (f rowFunc) Scan(dest ...any) error { return f(dest...) }

// errRow is a row that fails to scan with its error.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// errRows is pgx.Rows of a query that failed.
type errRows struct{ err error }

func (errRows) Close()                                       {}
func (r errRows) Err() error                                 { return r.err }
func (errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                          { return r.err }
func (r errRows) Values() ([]any, error)                     { return nil, r.err }
func (errRows) RawValues() [][]byte                          { return nil }
func (errRows) Conn() *pgx.Conn                              { return nil }
func (errRows) TypeMap() *pgtype.Map                         { return nil }
