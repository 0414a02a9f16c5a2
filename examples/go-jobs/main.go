// Jobs that run once however often the queue delivers them: a River queue
// "charges" in the application's database, whose job charges its amount
// into the same charges table as the example apps' POST /payments. The
// job's work is idempotency.Run keyed by the job's id: a job delivered
// again (its worker died after its work committed, before River heard of
// it) gets the stored result, and nothing is charged again.
//
//	./run worker            works on the queue until SIGTERM
//	./run enqueue AMOUNT    sends a job; prints its id
//	./run status ID         prints the job's state and output (JSON)
//	./run storm [once|bare] the redelivery storm: jobs per second, effects
//
// Environment: DATABASE_URL; JOBS_EXPIRE_SECONDS (default 60: how long a
// job may run before River's rescuer takes it for stuck and delivers it
// again); JOBS_ACK=transaction (River's completion, JobCompleteTx, commits
// with the job's work); for the tests, JOBS_CRASH=mid-job (the worker kills
// itself after writing the charge, before its transaction commits) or
// after-commit (after the job's work committed, before River's
// acknowledgment).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/idempotency/idempotency/clients/go/idempotency"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
)

// queue is the River queue of the charges.
const queue = "charges"

// ChargeArgs is a job charging Amount.
type ChargeArgs struct {
	Amount json.Number `json:"amount"`
}

// Kind names the job for River.
func (ChargeArgs) Kind() string { return "charge" }

// charged is a job's result: the id of its charge.
type charged struct {
	Charge int64 `json:"charge"`
}

// ChargeWorker works on the charges: each job's charge and its result
// commit together, once per job id.
type ChargeWorker struct {
	river.WorkerDefaults[ChargeArgs]
	pool *pgxpool.Pool
}

// Work charges the job's amount once per job id. With JOBS_ACK=transaction,
// River's completion of the job (JobCompleteTx) commits in the same
// transaction as the charge and the stored result; otherwise River
// completes it after Work returns, and a worker that dies in between leaves
// the job running until the rescuer delivers it again: that delivery gets
// the stored result. The result is the job's output either way.
func (w *ChargeWorker) Work(ctx context.Context, job *river.Job[ChargeArgs]) error {
	result, err := idempotency.Run(ctx, w.pool, idempotency.Work{
		Scope: "river:" + queue, Key: strconv.FormatInt(job.ID, 10), Args: job.Args,
	}, func(ctx context.Context, tx pgx.Tx) (charged, error) {
		var c charged
		err := tx.QueryRow(ctx, `INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id`,
			job.Args.Amount.String()).Scan(&c.Charge)
		if err != nil {
			return c, err
		}
		if os.Getenv("JOBS_CRASH") == "mid-job" {
			crash("mid-job: the charge is written, not committed")
		}
		if os.Getenv("JOBS_ACK") == "transaction" {
			if err := river.RecordOutput(ctx, c); err != nil {
				return c, err
			}
			_, err = river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		}
		return c, err
	})
	if err != nil {
		return err
	}
	if os.Getenv("JOBS_CRASH") == "after-commit" {
		crash("after-commit: the charge committed, not acknowledged")
	}
	return river.RecordOutput(ctx, result)
}

// crash ends the process at once, as a kill -9 would.
func crash(where string) {
	log.Printf("crashing (%s)", where)
	syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// expire is how long a job may run before the rescuer delivers it again.
func expire() time.Duration {
	s, err := strconv.Atoi(os.Getenv("JOBS_EXPIRE_SECONDS"))
	if err != nil || s <= 0 {
		s = 60
	}
	return time.Duration(s) * time.Second
}

// retryAtOnce is River's retry policy here: a failed or rescued job is
// delivered again at once (River's default backs off for attempt^4 s).
type retryAtOnce struct{}

func (retryAtOnce) NextRetry(*rivertype.JobRow) time.Time { return time.Now() }

// newClient makes a River client on pool: working the queues given (none:
// an insert-only client) with the workers given.
func newClient(pool *pgxpool.Pool, workers *river.Workers, queues map[string]river.QueueConfig) (*river.Client[pgx.Tx], error) {
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues: queues, Workers: workers, JobTimeout: expire(), RescueStuckJobsAfter: expire(),
		RetryPolicy: retryAtOnce{}, MaxAttempts: 25, Logger: nil,
	})
}

// migrate brings River's tables up to date and makes the charges table;
// one process at a time (an advisory lock).
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(4004)`); err != nil {
		return err
	}
	defer conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock(4004)`)
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return err
	}
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		amount numeric NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}

// work works on the queue until SIGTERM or SIGINT.
func work(ctx context.Context, pool *pgxpool.Pool) error {
	workers := river.NewWorkers()
	river.AddWorker(workers, &ChargeWorker{pool: pool})
	client, err := newClient(pool, workers, map[string]river.QueueConfig{queue: {MaxWorkers: 1}})
	if err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return err
	}
	fmt.Println("working")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	return client.Stop(context.Background())
}

// enqueue sends a job charging amount; prints its id.
func enqueue(ctx context.Context, pool *pgxpool.Pool, amount string) error {
	client, err := newClient(pool, nil, nil)
	if err != nil {
		return err
	}
	res, err := client.Insert(ctx, ChargeArgs{Amount: json.Number(amount)}, &river.InsertOpts{Queue: queue})
	if err != nil {
		return err
	}
	fmt.Println(res.Job.ID)
	return nil
}

// status prints the state and output of job id.
func status(ctx context.Context, pool *pgxpool.Pool, id string) error {
	n, err := strconv.ParseInt(id, 10, 64)
	if err != nil {
		return err
	}
	client, err := newClient(pool, nil, nil)
	if err != nil {
		return err
	}
	job, err := client.JobGet(ctx, n)
	if errors.Is(err, river.ErrNotFound) {
		fmt.Println("none")
		return nil
	}
	if err != nil {
		return err
	}
	output := job.Output()
	if output == nil {
		output = []byte("null")
	}
	fmt.Printf("%s %s\n", job.State, output)
	return nil
}

func main() {
	log.SetFlags(0)
	if len(os.Args) < 2 {
		usage()
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatalf("DATABASE_URL: %v", err)
	}
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	arg := ""
	if len(os.Args) > 2 {
		arg = os.Args[2]
	}
	switch os.Args[1] {
	case "worker":
		err = work(ctx, pool)
	case "enqueue":
		err = enqueue(ctx, pool, arg)
	case "status":
		err = status(ctx, pool, arg)
	case "storm":
		err = storm(ctx, pool, arg)
	default:
		usage()
	}
	if err != nil {
		log.Fatal(err)
	}
}

// usage says how to call the program, and exits.
func usage() {
	log.Print("usage: run worker | enqueue AMOUNT | status ID | storm [once | bare]")
	os.Exit(2)
}
