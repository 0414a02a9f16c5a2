package idempotency

import (
	"bytes"
	"testing"
)

// str returns a pointer to s: a query that is present.
func str(s string) *string { return &s }

func TestFingerprintEqualsTheExtensions(t *testing.T) {
	cases := []struct {
		name, method, path string
		body               []byte
		query              *string
	}{
		{"JSON body, no query", "POST", "/payments", []byte(`{"amount":10}`), nil},
		{"lowercase method", "post", "/payments", []byte(`{"amount":10}`), nil},
		{"mixed-case method", "PaTcH", "/payments/1", []byte(`{}`), str("a=1&b=2")},
		{"non-ASCII method: only a-z are upper-cased", "pöst", "/p", nil, nil},
		{"no body, no query", "POST", "/payments", nil, nil},
		{"empty body", "POST", "/payments", []byte{}, nil},
		{"empty query", "POST", "/payments", nil, str("")},
		{"binary body", "PUT", "/blob", []byte{0, 0xff, 0x80, '\r', '\n', 0}, str("x")},
		{"empty path", "POST", "", nil, nil},
		{"a split one way", "a", "bc", nil, nil},
		{"a split the other way", "ab", "c", nil, nil},
		{"long body", "POST", "/p", bytes.Repeat([]byte("0123456789"), 100000), nil},
	}
	seen := map[string]string{}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var want []byte
			err := pool.QueryRow(ctx, `SELECT idempotency.fingerprint($1, $2, $3, $4)`,
				c.method, c.path, c.body, c.query).Scan(&want)
			if err != nil {
				t.Fatal(err)
			}
			got := Fingerprint(c.method, c.path, c.body, c.query)
			if !bytes.Equal(got, want) {
				t.Fatalf("Go %x, extension %x", got, want)
			}
			seen[c.name] = string(got)
		})
	}
	same := func(a, b string) bool { return seen[a] == seen[b] }
	if !same("JSON body, no query", "lowercase method") {
		t.Error("the method's case changed the fingerprint")
	}
	for _, pair := range [][2]string{{"no body, no query", "empty body"},
		{"no body, no query", "empty query"}, {"a split one way", "a split the other way"}} {
		if same(pair[0], pair[1]) {
			t.Errorf("%q and %q have the same fingerprint", pair[0], pair[1])
		}
	}
}
