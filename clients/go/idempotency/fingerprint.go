package idempotency

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
)

// Fingerprint returns what idempotency.fingerprint(method, path, body, query)
// returns: the SHA-256 of the request's parts, each written as a presence
// byte, an 8-byte big-endian length and its bytes. The method is upper-cased
// (ASCII letters only, as the extension does). A nil body or query is absent
// (SQL NULL), which differs from an empty one.
func Fingerprint(method, path string, body []byte, query *string) []byte {
	h := sha256.New()
	writePart(h, []byte(asciiUpper(method)), true)
	writePart(h, []byte(path), true)
	writePart(h, body, body != nil)
	if query != nil {
		writePart(h, []byte(*query), true)
	} else {
		writePart(h, nil, false)
	}
	return h.Sum(nil)
}

// writePart feeds one part, or its absence, to h.
func writePart(h hash.Hash, data []byte, present bool) {
	var header [9]byte
	if present {
		header[0] = 1
		binary.BigEndian.PutUint64(header[1:], uint64(len(data)))
	}
	h.Write(header[:])
	h.Write(data)
}

// asciiUpper upper-cases a-z only, leaving every other byte as it is.
func asciiUpper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'a' <= c && c <= 'z' {
			b[i] = c - ('a' - 'A')
		}
	}
	return string(b)
}
