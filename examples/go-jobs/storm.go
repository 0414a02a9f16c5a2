package main

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/idempotency/idempotency/clients/go/idempotency"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
)

// The redelivery storm: orders units of work, each sent as deliveries jobs
// (what a queue redelivering every job that often would hand the workers),
// worked on by workers at once.
const (
	stormOrders     = 100
	stormDeliveries = 20
	stormWorkers    = 8
	// River fetches at most MaxWorkers jobs per FetchCooldown (100 ms by
	// default: 80 jobs/s here whatever the jobs cost); the storm measures the jobs.
	stormFetchCooldown = 5 * time.Millisecond
)

// StormArgs is a delivery of an order of the storm.
type StormArgs struct {
	Order int `json:"order"`
}

// Kind names the storm's job for River.
func (StormArgs) Kind() string { return "storm" }

// StormWorker works on the storm's deliveries: with once, the effect runs in
// idempotency.Run keyed by the order; else bare, in a transaction of its own.
type StormWorker struct {
	river.WorkerDefaults[StormArgs]
	pool       *pgxpool.Pool
	once       bool
	queue      string
	done, left atomic.Int64
	finished   chan struct{}
}

// Work runs the order's effect (once per order, or bare).
func (w *StormWorker) Work(ctx context.Context, job *river.Job[StormArgs]) error {
	effect := func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, `INSERT INTO storm_effects VALUES ($1, $2, $3)`, job.Args.Order, w.mode(), w.queue)
		return job.Args.Order, err
	}
	var err error
	if w.once {
		_, err = idempotency.Run(ctx, w.pool, idempotency.Work{Scope: "storm",
			Key: w.queue + ":" + strconv.Itoa(job.Args.Order), Args: job.Args}, effect,
			idempotency.RunOptions{Wait: 30 * time.Second})
	} else {
		err = pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error { _, err := effect(ctx, tx); return err })
	}
	if err == nil && w.left.Add(-1) == 0 {
		close(w.finished)
	}
	return err
}

// mode names the storm's mode.
func (w *StormWorker) mode() string {
	if w.once {
		return "once"
	}
	return "bare"
}

// storm runs the storm with the job wrapped in Run (mode "once", the
// default) or the bare handler ("bare"); prints jobs per second and how many
// effects the orders got.
func storm(ctx context.Context, pool *pgxpool.Pool, mode string) error {
	if mode == "" {
		mode = "once"
	}
	if mode != "once" && mode != "bare" {
		return fmt.Errorf("storm once | bare")
	}
	queue := fmt.Sprintf("storm_%s_%d", mode, time.Now().UnixNano())
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS storm_effects (order_id int NOT NULL, mode text NOT NULL, queue text NOT NULL)`); err != nil {
		return err
	}
	w := &StormWorker{pool: pool, once: mode == "once", queue: queue, finished: make(chan struct{})}
	total := stormOrders * stormDeliveries
	w.left.Store(int64(total))
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client, err := newClient(pool, workers, map[string]river.QueueConfig{queue: {
		MaxWorkers: stormWorkers, FetchCooldown: stormFetchCooldown}})
	if err != nil {
		return err
	}
	var jobs []river.InsertManyParams
	for d := 0; d < stormDeliveries; d++ {
		for order := 0; order < stormOrders; order++ {
			jobs = append(jobs, river.InsertManyParams{Args: StormArgs{Order: order}, InsertOpts: &river.InsertOpts{Queue: queue}})
		}
	}
	if _, err := client.InsertMany(ctx, jobs); err != nil {
		return err
	}
	started := time.Now()
	if err := client.Start(ctx); err != nil {
		return err
	}
	<-w.finished
	seconds := time.Since(started).Seconds()
	client.Stop(ctx)
	var effects, orders, most int
	err = pool.QueryRow(ctx, `SELECT coalesce(sum(n), 0)::int, count(*)::int, coalesce(max(n), 0)::int
		FROM (SELECT order_id, count(*) AS n FROM storm_effects WHERE queue = $1 GROUP BY order_id) AS o`,
		queue).Scan(&effects, &orders, &most)
	if err != nil {
		return err
	}
	fmt.Printf("%s: %d jobs (%d orders x %d) over %d workers: %.0f jobs/s; %d effects on %d orders, at most %d per order\n",
		mode, total, stormOrders, stormDeliveries, stormWorkers, float64(total)/seconds, effects, orders, most)
	return nil
}
