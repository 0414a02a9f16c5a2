// Types of pg-idempotency/node-idempotency.

import type { Queryable, TracerProviderLike } from './index';

export interface PostgresStorageAdapterOptions {
  /** A pg.Pool on a database with the idempotency extension. */
  pool: Queryable;
  /** How long an in-progress request holds its key, in milliseconds (default 60000). */
  leaseMs?: number;
  /** Whose records these are (default ''). */
  scope?: string;
  /** Where the spans go (default OpenTelemetry's global tracer provider). */
  tracerProvider?: TracerProviderLike | null;
}

/** A StorageAdapter (@node-idempotency/storage) on the idempotency extension. */
export declare class PostgresStorageAdapter {
  constructor(options: PostgresStorageAdapterOptions);
  setIfNotExists(key: string, val: string, options?: { ttl?: number }): Promise<boolean>;
  set(key: string, val: string, options?: { ttl?: number }): Promise<void>;
  get(key: string): Promise<string | undefined>;
}
