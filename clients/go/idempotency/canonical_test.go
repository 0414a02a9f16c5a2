package idempotency

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"testing"
)

// The shared vectors of clients/testdata/function-fingerprints.json: Run's
// fingerprint of each vector's arguments is the one every client makes of them.
func TestArgsFingerprintVectors(t *testing.T) {
	data, err := os.ReadFile("../../testdata/function-fingerprints.json")
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Vectors []struct{ Name, Arguments, Canonical, Sha256 string }
	}
	if err := json.Unmarshal(data, &file); err != nil || len(file.Vectors) == 0 {
		t.Fatalf("%d vectors: %v", len(file.Vectors), err)
	}
	for _, v := range file.Vectors {
		t.Run(v.Name, func(t *testing.T) {
			args := json.RawMessage(v.Arguments)
			canonical, err := canonicalJSON(args)
			if err != nil || string(canonical) != v.Canonical {
				t.Fatalf("canonical JSON %s (%v); want %s", canonical, err, v.Canonical)
			}
			fp, err := ArgsFingerprint(args)
			if err != nil || hex.EncodeToString(fp) != v.Sha256 {
				t.Fatalf("fingerprint %x (%v); want %s", fp, err, v.Sha256)
			}
		})
	}
}
