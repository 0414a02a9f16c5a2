package idempotency

import (
	"errors"
	"strings"
)

// maxKeyBytes is the longest key the extension takes.
const maxKeyBytes = 255

// Why an Idempotency-Key field is refused.
var (
	errKeyMissing = errors.New("the Idempotency-Key header is required")
	errKeyInvalid = errors.New("the Idempotency-Key header must be one Structured Field string " +
		`of 1 to 255 bytes, such as "8e03978e-40d5-43e8-bc93-6894a57f9324"`)
)

// ParseKey returns the key that the Idempotency-Key field lines carry: one
// Structured Field string (RFC 8941), or a bare value of token characters
// (plus ':' and '/', not starting with ':'), which is the same key as its
// quoted form. Anything else, several lines, an empty key or one over 255
// bytes is an error.
func ParseKey(lines []string) (string, error) {
	if len(lines) == 0 {
		return "", errKeyMissing
	}
	if len(lines) > 1 {
		return "", errKeyInvalid
	}
	value := strings.Trim(lines[0], " \t")
	var key string
	var ok bool
	if strings.HasPrefix(value, `"`) {
		key, ok = parseSFString(value)
	} else {
		key, ok = value, isBareKey(value)
	}
	if !ok || key == "" || len(key) > maxKeyBytes {
		return "", errKeyInvalid
	}
	return key, nil
}

// parseSFString unescapes a whole sf-string: a double quote, printable
// ASCII with \" and \\ as the only escapes, a double quote, nothing after.
func parseSFString(s string) (string, bool) {
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\':
			i++
			if i == len(s) || (s[i] != '"' && s[i] != '\\') {
				return "", false
			}
			b.WriteByte(s[i])
		case c == '"':
			return b.String(), i == len(s)-1
		case c < 0x20 || c > 0x7e:
			return "", false
		default:
			b.WriteByte(c)
		}
	}
	return "", false // no closing quote
}

// isBareKey reports whether s is made of tchar, ':' and '/' only, and does
// not start with ':' (a Structured Field byte sequence).
func isBareKey(s string) bool {
	if s == "" || s[0] == ':' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isTchar(s[i]) && s[i] != ':' && s[i] != '/' {
			return false
		}
	}
	return true
}

// isTchar reports whether c is an RFC 9110 token character.
func isTchar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
