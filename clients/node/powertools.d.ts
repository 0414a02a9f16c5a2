// Types of pg-idempotency/powertools.

import { BasePersistenceLayer, IdempotencyRecord } from '@aws-lambda-powertools/idempotency/persistence';
import type { Queryable, TracerProviderLike } from './index';

export interface PostgresPersistenceLayerOptions {
  /** A pg.Pool on a database with the idempotency extension. */
  pool: Queryable;
  /** Whose records these are (default ''). */
  scope?: string;
  /** The lease when no Lambda context is registered, in milliseconds (default 60000). */
  leaseMs?: number;
  /** Where the spans go (default OpenTelemetry's global tracer provider). */
  tracerProvider?: TracerProviderLike | null;
}

/** A Powertools persistence layer on the idempotency extension. */
export declare class PostgresPersistenceLayer extends BasePersistenceLayer {
  constructor(options: PostgresPersistenceLayerOptions);
  protected _putRecord(record: IdempotencyRecord): Promise<void>;
  protected _updateRecord(record: IdempotencyRecord): Promise<void>;
  protected _deleteRecord(record: IdempotencyRecord): Promise<void>;
  protected _getRecord(idempotencyKey: string): Promise<IdempotencyRecord>;
}
