package idempotency

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
)

// canonicalJSON writes v as every client of the project writes the
// arguments of an idempotent function (clients/testdata/function-fingerprints.json):
// as JavaScript's JSON.stringify writes v's JSON, with object keys sorted by
// UTF-16 code units and no whitespace. encoding/json would escape <, >, &,
// U+2028 and U+2029, and sort keys by bytes: v is encoded, decoded as generic
// JSON, then written here.
func canonicalJSON(v any) ([]byte, error) {
	first, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(first))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := writeCanonical(&b, generic); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// writeCanonical appends the canonical JSON of v, a value decoded with UseNumber.
func writeCanonical(b *bytes.Buffer, v any) error {
	switch v := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case string:
		writeJSString(b, v)
	case json.Number:
		return writeJSNumber(b, v)
	case []any:
		b.WriteByte('[')
		for i, item := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			if err := writeCanonical(b, item); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, func(x, y string) int {
			return slices.Compare(utf16.Encode([]rune(x)), utf16.Encode([]rune(y)))
		})
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSString(b, k)
			b.WriteByte(':')
			if err := writeCanonical(b, v[k]); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	default:
		return fmt.Errorf("a value of type %T", v)
	}
	return nil
}

// writeJSNumber appends n as JavaScript writes a number: an integer as its
// digits, any other as the float64 it reads as (encoding/json formats a
// float64 as ECMAScript does, but for -0).
func writeJSNumber(b *bytes.Buffer, n json.Number) error {
	s := n.String()
	if !strings.ContainsAny(s, ".eE") {
		if s == "-0" {
			s = "0"
		}
		b.WriteString(s)
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return err
	}
	if f == 0 {
		b.WriteByte('0')
		return nil
	}
	text, err := json.Marshal(f)
	if err != nil {
		return err
	}
	b.Write(text)
	return nil
}

// writeJSString appends s quoted as JSON.stringify quotes it: only '"', '\'
// and control characters escaped.
func writeJSString(b *bytes.Buffer, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if r < 0x20 {
				fmt.Fprintf(b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}
