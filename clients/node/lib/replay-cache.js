'use strict';
// Replays from memory: a bounded cache of completed responses, keyed by
// scope, key and fingerprint. A completed record never changes until it
// expires, so a repeat of a request answered from here gets what the
// database would give. Only replays are kept (never an in-progress key),
// each until the record's expires_at (the application's clock) at the
// latest; the least recently used entries go first.

const DEFAULTS = {
  max: 1000, // entries
  maxBytes: 8 * 1024 * 1024, // bodies and headers, in all
  maxEntryBytes: 64 * 1024, // a larger response is not kept
};

class ReplayCache {
  constructor(options = {}) {
    this.limits = { ...DEFAULTS, ...options };
    this.entries = new Map(); // insertion order = least recently used first
    this.bytes = 0;
  }

  // Returns the remembered replay of this request, or undefined.
  get(scope, key, fp) {
    const id = entryId(scope, key, fp);
    const entry = this.entries.get(id);
    if (entry === undefined) return undefined;
    this.entries.delete(id);
    if (entry.expiresAt <= Date.now()) {
      this.bytes -= entry.size;
      return undefined;
    }
    this.entries.set(id, entry);
    return entry.claim;
  }

  // Remembers a replay (a claim answered replay, with its expiresAt).
  set(scope, key, fp, claim) {
    const expiresAt = claim.expiresAt instanceof Date ? claim.expiresAt.getTime() : NaN;
    if (!(expiresAt > Date.now())) return; // unknown or past: the database decides
    const size = (claim.body?.length ?? 0) + JSON.stringify(claim.headers ?? {}).length + key.length + scope.length;
    if (size > this.limits.maxEntryBytes) return;
    const id = entryId(scope, key, fp);
    const old = this.entries.get(id);
    if (old) {
      this.entries.delete(id);
      this.bytes -= old.size;
    }
    const { statusCode, headers, body } = claim;
    this.entries.set(id, { claim: { outcome: 'replay', statusCode, headers, body }, expiresAt, size });
    this.bytes += size;
    for (const [oldest, entry] of this.entries) {
      if (this.entries.size <= this.limits.max && this.bytes <= this.limits.maxBytes) break;
      this.entries.delete(oldest);
      this.bytes -= entry.size;
    }
  }
}

// Returns the cache's key of a request: scope, key and fingerprint, unambiguous.
function entryId(scope, key, fp) {
  return `${scope.length}:${scope}${key.length}:${key}${Buffer.from(fp.buffer, fp.byteOffset, fp.byteLength).toString('base64')}`;
}

module.exports = { ReplayCache };
