'use strict';
// Keys that other libraries build (a prefix, a path, a hash...) may exceed
// what the extension accepts as a key (1..255 bytes, no control characters):
// those are stored under the SHA-256 of the key instead.

const crypto = require('node:crypto');

// Returns the key to store: the key itself when the extension accepts it, else 'sha256:<hex>'.
function storageKey(key) {
  const text = String(key);
  const byteLength = Buffer.byteLength(text);
  // eslint-disable-next-line no-control-regex
  if (byteLength >= 1 && byteLength <= 255 && !/[\u0000-\u001f\u007f]/.test(text)) return text;
  return `sha256:${crypto.createHash('sha256').update(text).digest('hex')}`;
}

module.exports = { storageKey };
