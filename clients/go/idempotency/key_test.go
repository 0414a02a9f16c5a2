package idempotency

import (
	"strings"
	"testing"
)

func TestParseKeyAccepts(t *testing.T) {
	cases := map[string]string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`8e03978e-40d5-43e8-bc93-6894a57f9324`:   "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`"abc"`:                                  "abc",
		`abc`:                                    "abc",
		" \t\"abc\" \t":                          "abc",
		`"say \"hi\" \\ bye"`:                    `say "hi" \ bye`,
		`"a b;c,d"`:                              "a b;c,d",
		`"~"`:                                    "~",
		`*tok/en:1`:                              "*tok/en:1",
		`42`:                                     "42",
		`-1.5`:                                   "-1.5",
		`!#$%&'*+-.^_|~` + "`":                   `!#$%&'*+-.^_|~` + "`",
		`"` + strings.Repeat("k", 255) + `"`:     strings.Repeat("k", 255),
	}
	for field, want := range cases {
		got, err := ParseKey([]string{field})
		if err != nil || got != want {
			t.Errorf("ParseKey(%q) = %q, %v; want %q", field, got, err, want)
		}
	}
}

func TestParseKeyRefuses(t *testing.T) {
	invalid := []string{
		`"unterminated`, `"abc";x=1`, `"abc" x`, `?1`, `:YWJj:`, `(a b)`, `""`, `"a\qb"`,
		`"a\"`, `"a", "b"`, `a b`, ``, ` `, `a,b`, `a;b`, `"tab` + "\t" + `"`, `"é"`, `é`,
		`"` + strings.Repeat("k", 256) + `"`, strings.Repeat("k", 256), `@home`, `a=b`,
	}
	for _, field := range invalid {
		if key, err := ParseKey([]string{field}); err != errKeyInvalid {
			t.Errorf("ParseKey(%q) = %q, %v; want invalid", field, key, err)
		}
	}
	if _, err := ParseKey([]string{`"a"`, `"a"`}); err != errKeyInvalid {
		t.Errorf("two field lines: %v, want invalid", err)
	}
	if _, err := ParseKey(nil); err != errKeyMissing {
		t.Errorf("no field: %v, want missing", err)
	}
}
