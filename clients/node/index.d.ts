// Types of pg-idempotency: Idempotency-Key on the idempotency PostgreSQL extension.

import type { IncomingMessage, ServerResponse } from 'node:http';

/** Anything that runs a query: a pg.Pool, a pg.Client or a client of a pool. */
export interface Queryable {
  query(text: string, values?: unknown[]): Promise<{ rows: any[] }>;
}

/** A pg.Pool (what the middleware takes connections from). */
export interface PoolLike extends Queryable {
  connect(): Promise<Queryable & { release(err?: Error | boolean): void }>;
}

/**
 * An OpenTelemetry TracerProvider (from @opentelemetry/api, an optional peer
 * dependency: this shape keeps the types usable without it installed).
 */
export interface TracerProviderLike {
  getTracer(name: string, version?: string, options?: object): unknown;
}

/** An interval: PostgreSQL interval text ('60 seconds') or milliseconds. */
export type Interval = string | number;

/** The request parts of a fingerprint: text (UTF-8) or bytes. */
export type Bytes = string | Uint8Array;

/** SHA-256 of the request, exactly as idempotency.fingerprint(method, path, body, query). */
export function fingerprint(method: string, path: string, body?: Bytes | null, query?: Bytes | null): Buffer;

/** Parses an Idempotency-Key field value; null when it is not a valid key. */
export function parseIdempotencyKey(value: string | undefined): string | null;

/** The scope the middleware gives a request: the SHA-256 of its credential, '' without one. */
export function credentialScope(req: IncomingMessage): string;

/** What claim() answers. */
export interface Claim {
  outcome: 'new' | 'replay' | 'in_progress' | 'mismatch';
  /** The fencing token of a 'new' claim (a bigint, as text); null otherwise. */
  fence: string | null;
  attempt: number | null;
  statusCode: number | null;
  headers: Record<string, string | string[]> | null;
  body: Buffer | null;
  recoveryPoint: string | null;
  recoveryState: unknown;
  /** For 'in_progress': whole seconds until the lease ends, at least 1. */
  retryAfter: number | null;
  createdAt: Date | null;
}

/** What lookup() shows: the record as claim would see it, without its fence. */
export interface IdempotencyRecord {
  key: string;
  scope: string;
  fingerprint: Buffer;
  state: 'in_progress' | 'completed';
  attempt: number;
  lease: unknown;
  leaseExpiresAt: Date | null;
  recoveryPoint: string | null;
  recoveryState: unknown;
  statusCode: number | null;
  headers: Record<string, string | string[]> | null;
  body: Buffer | null;
  createdAt: Date;
  completedAt: Date | null;
  expiresAt: Date;
}

export interface CallOptions {
  /** The caller's scope; default: the client's, else the setting idempotency.scope. */
  scope?: string | null;
  /** Run on this connection (e.g. the transaction of the business writes). */
  db?: Queryable;
}

export interface ClaimOptions extends CallOptions {
  lease?: Interval | null;
  retention?: Interval | null;
  /** Wait up to this long for an in-progress owner before answering. */
  wait?: Interval | null;
  /** This attempt's id (a UUID): the same token asked again answers new again while the claim is in progress. */
  token?: string | null;
}

export interface CompleteOptions extends CallOptions {
  /** Keep a 5xx response (idempotency.store_server_errors on for this call). */
  storeServerErrors?: boolean;
}

export interface ClientDefaults {
  scope?: string | null;
  lease?: Interval | null;
  retention?: Interval | null;
  /** Where the spans go (default OpenTelemetry's global tracer provider). */
  tracerProvider?: TracerProviderLike | null;
}

/** A small client of the extension's SQL API. */
export class IdempotencyClient {
  constructor(db: Queryable, defaults?: ClientDefaults);
  static fingerprint: typeof fingerprint;
  claim(key: string, fingerprint: Bytes, options?: ClaimOptions): Promise<Claim>;
  /** 'stored', or 'released' for a 5xx. Throws ClaimLostError when the fence lost the claim. */
  complete(key: string, fence: string, statusCode: number, body?: Bytes | null,
    headers?: Record<string, string | string[]> | null, options?: CompleteOptions): Promise<'stored' | 'released'>;
  /** False when this fence no longer owns the claim. */
  release(key: string, fence: string, options?: CallOptions): Promise<boolean>;
  /** The lease's new end. Throws ClaimLostError when the fence lost the claim. */
  extend(key: string, fence: string, options?: CallOptions & { lease?: Interval | null }): Promise<Date>;
  checkpoint(key: string, fence: string, recoveryPoint: string, recoveryState?: unknown,
    options?: CallOptions): Promise<void>;
  lookup(key: string, options?: CallOptions): Promise<IdempotencyRecord | null>;
}

/** complete, extend or checkpoint by a fence that lost its claim (SQLSTATE IK001). */
export class ClaimLostError extends Error {
  readonly code: 'IK001';
  readonly key: string;
}

export type ProblemCode =
  | 'idempotency_key_missing' | 'idempotency_key_invalid' | 'idempotency_key_in_progress'
  | 'idempotency_key_mismatch' | 'idempotency_claim_lost' | 'idempotency_unavailable' | 'webhook_unverified'
  | 'idempotency_redact_failed';

/** A response as complete stores it: what the redact option gets and returns. */
export interface StoredResponse {
  status: number;
  /** The headers a replay repeats (storeHeaders), as { name: value or values }. */
  headers: Record<string, string | string[]>;
  body: Buffer;
}

export interface MiddlewareOptions {
  /** The methods that take a key (default POST, PATCH). */
  methods?: string[];
  /** 400 when a covered request has no key (default true); false runs it unguarded. */
  required?: boolean;
  /** When an idempotency call fails: false (default) answers 503, true runs the handler unguarded. */
  failOpen?: boolean;
  /** How many times a claim whose answer was lost is asked again on a fresh connection (default 3), then 503. */
  retries?: number;
  /** Milliseconds before the first ask again, doubled each time (default 50). */
  retryDelay?: number;
  /** How long a running request holds its key (default null: the setting idempotency.lease, 60s). */
  lease?: Interval | null;
  /** How long a response is replayed (default: the setting idempotency.retention, 24h). */
  retention?: Interval | null;
  /** The response headers a replay repeats (default content-type, location). */
  storeHeaders?: string[];
  /** The largest request body read, in bytes (default 1 MiB). */
  limit?: number;
  /** The caller's scope (default credentialScope). */
  scope?: (req: IncomingMessage) => string;
  /** The type URI of each problem (default about:blank). */
  problemTypes?: Partial<Record<ProblemCode, string>>;
  /** Where failures are reported (default console.error). */
  log?: (message: string) => void;
  /** The claim, the handler's writes and complete in one transaction (default false: the claim commits first). */
  oneTransaction?: boolean;
  /** How long a duplicate waits for the request it repeats (default none; with oneTransaction '2 seconds', and it must be positive). */
  wait?: Interval | null;
  /** With oneTransaction on pg 8.23 or later: run the handler while the claim's answer is on its way (default true). */
  runAhead?: boolean;
  /** Claim and complete as SQL prepared statements, prepared once per connection (default false); not through a transaction pooler. */
  prepare?: boolean;
  /** Replays from memory (default true: 1000 responses, 8 MiB, none over 64 KiB). */
  cache?: boolean | { max?: number; maxBytes?: number; maxEntryBytes?: number };
  /** Where the spans go (default OpenTelemetry's global tracer provider). */
  tracerProvider?: TracerProviderLike | null;
  /** The key of a request (default: its Idempotency-Key field); undefined when none was sent, null when malformed. */
  key?: (req: IncomingMessage & { body?: unknown }) => string | null | undefined;
  /** Runs before anything is claimed; throws when the request is not authentic (a webhook's signature): 401 webhook_unverified. */
  verify?: ((req: IncomingMessage & { rawBody: Buffer }) => void | Promise<void>) | null;
  /** What complete stores of a response (default null: the response itself); the live response is unchanged, a replay sends what was stored; a redact that throws stores nothing: 500 idempotency_redact_failed. */
  redact?: ((stored: StoredResponse) => { status: number; headers: Record<string, string | string[]>; body: Buffer | string }) | null;
}

/** What verifies a Standard Webhooks delivery: new Webhook(secret) of the package standardwebhooks. */
export interface WebhookVerifier {
  verify(payload: Buffer, headers: Record<string, string>): unknown;
}

/** The middleware options of a Standard Webhooks receiver: verified before the claim, key = webhook-id, scope = `webhook:${sender}`. */
export function standardWebhook(webhook: WebhookVerifier, options?: { sender?: string }):
  Required<Pick<MiddlewareOptions, 'methods' | 'verify' | 'key' | 'scope'>>;

/** A key option reading a string field of the JSON body (default "id", Stripe's event id). */
export function bodyKey(field?: string): NonNullable<MiddlewareOptions['key']>;

/** What an idempotent function gets as its first argument. */
export interface Run {
  /** A client in the transaction whose writes commit with the stored result. */
  db: Queryable;
  key: string;
  scope: string | null;
  /** 1, or more after a takeover (two transactions: a run that outlived its lease or died). */
  attempt: number;
  /** The last checkpoint of an earlier attempt (two transactions), else null. */
  recoveryPoint: string | null;
  recoveryState: unknown;
  /** Records a recovery point (two transactions: committed at once, the lease renewed). */
  checkpoint(point: string, state?: unknown): Promise<void>;
}

export interface IdempotentOptions<A extends unknown[]> {
  /** The unit of work's key, from the arguments. */
  key: (...args: A) => string;
  /** Its scope (default null: the setting idempotency.scope). */
  scope?: string | null | ((...args: A) => string);
  /** true (default): the claim, the function's writes and its result in one transaction; false: the claim commits first (a function that calls out). */
  oneTransaction?: boolean;
  /** Default null: the setting idempotency.lease; renewed while the function runs (two transactions). */
  lease?: Interval | null;
  retention?: Interval | null;
  /** How long a duplicate waits for the run in progress (default '2 seconds'). */
  wait?: Interval | null;
  /** Milliseconds between lease renewals (default a third of the lease). */
  extendEvery?: number | null;
  /** Which errors are stored and given back to duplicates (default: those with final: true). */
  final?: (err: unknown) => boolean;
  /** The result as stored (default JSON.stringify) and back (default JSON.parse). */
  serialize?: (value: any) => string | null;
  deserialize?: (text: string | null) => any;
  retries?: number;
  retryDelay?: number;
  log?: (message: string) => void;
  tracerProvider?: TracerProviderLike | null;
}

/** Wraps fn so that each unit of work (options.key of its arguments) runs once; duplicates get its result. */
export function idempotent<A extends unknown[], R>(pool: PoolLike, fn: (run: Run, ...args: A) => Promise<R>,
  options: IdempotentOptions<A>): (...args: A) => Promise<R>;

/** A duplicate found the unit of work still running after its wait. */
export class IdempotencyInProgressError extends Error {
  readonly code: 'idempotency_key_in_progress';
  readonly key: string;
  /** Whole seconds until the running one's lease ends. */
  readonly retryAfter: number;
}

/** The key was used with other arguments. */
export class IdempotencyMismatchError extends Error {
  readonly code: 'idempotency_key_mismatch';
  readonly key: string;
}

/** The first run failed with a final error, given back to a duplicate. */
export class IdempotencyStoredError extends Error {
  readonly code: 'idempotency_stored_error';
  readonly key: string;
  readonly error: { name: string; message: string; code: string | null };
}

/** Express middleware; gives the handler req.db (a transaction), req.rawBody and a parsed req.body. */
export function idempotency(pool: PoolLike, options?: MiddlewareOptions):
  (req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => void;

declare global {
  namespace Express {
    interface Request {
      /** The transaction the response is stored in; write through it. */
      db?: Queryable;
      /** The request body as received. */
      rawBody?: Buffer;
    }
  }
}
