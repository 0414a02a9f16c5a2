package idempotency

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

// testSecret is the Standard Webhooks secret of these tests.
var testSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("the secret of the webhook tests"))

// delivery is a Standard Webhooks delivery of body as event id, signed by
// wh at ts; the X-Key header names the writes of the charge handler.
func delivery(t *testing.T, wh *standardwebhooks.Webhook, id, body string, ts time.Time) call {
	t.Helper()
	sig, err := wh.Sign(id, ts, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return call{path: "/webhooks", body: body, header: map[string]string{"X-Key": id, "webhook-id": id,
		"webhook-timestamp": strconv.FormatInt(ts.Unix(), 10), "webhook-signature": sig}}
}

// A Standard Webhooks receiver: a delivery is verified before anything is
// claimed (a bad signature or an old timestamp: 401, no record); the key is
// the webhook-id, the scope the sender; a redelivery (new timestamp, new
// signature) replays the first answer; the same id with another payload is 422.
func TestStandardWebhook(t *testing.T) {
	wh, err := standardwebhooks.NewWebhook(testSecret)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := standardwebhooks.NewWebhook("whsec_" + base64.StdEncoding.EncodeToString([]byte("another secret")))
	var runs int32
	srv := serve(t, pool, StandardWebhook(wh, "acme"), charge(&runs))
	id := uniqueKey(t)
	first := send(t, srv, delivery(t, wh, id, `{"amount":1}`, time.Now()))
	if first.status != 201 || runs != 1 {
		t.Fatalf("first delivery: %d %s", first.status, first.body)
	}
	again := send(t, srv, delivery(t, wh, id, `{"amount":1}`, time.Now().Add(time.Second)))
	if again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again.body, first.body) || runs != 1 {
		t.Fatalf("redelivery: %d %v %s after %d runs", again.status, again.header, again.body, runs)
	}
	wantProblem(t, send(t, srv, delivery(t, wh, id, `{"amount":2}`, time.Now())), 422, CodeKeyMismatch)
	rec, err := Lookup(ctx, pool, "webhook:acme", id)
	if err != nil || rec == nil || rec.State != "completed" {
		t.Fatalf("the record of the webhook-id in the sender's scope: %+v %v", rec, err)
	}
	unsigned := delivery(t, wh, uniqueKey(t), `{"amount":3}`, time.Now())
	delete(unsigned.header, "webhook-signature")
	for name, c := range map[string]call{
		"forged":   delivery(t, other, uniqueKey(t), `{"amount":3}`, time.Now()),
		"old":      delivery(t, wh, uniqueKey(t), `{"amount":3}`, time.Now().Add(-10*time.Minute)),
		"ahead":    delivery(t, wh, uniqueKey(t), `{"amount":3}`, time.Now().Add(10*time.Minute)),
		"unsigned": unsigned,
		"no id":    {path: "/webhooks", body: `{}`, header: map[string]string{"X-Key": "none"}},
	} {
		wantProblem(t, send(t, srv, c), 401, CodeWebhookUnverified)
		if id := c.header["webhook-id"]; id == "" {
			continue
		} else if rec, err := Lookup(ctx, pool, "webhook:acme", id); rec != nil || err != nil {
			t.Fatalf("%s: a record %+v %v", name, rec, err)
		}
	}
	if runs != 1 {
		t.Fatalf("%d runs", runs)
	}
}

// BodyKey: the key is a string field of the body, after the sender's own
// verification; an unverified delivery is 401, a verified body without the
// field 400, and neither claims anything.
func TestBodyKey(t *testing.T) {
	var runs int32
	verify := func(r *http.Request, body []byte) error {
		if r.Header.Get("Stripe-Signature") != "ok" {
			return errors.New("bad signature")
		}
		return nil
	}
	srv := serve(t, pool, BodyKey("id", verify, "stripe"), charge(&runs))
	id := uniqueKey(t)
	event := call{path: "/webhooks", body: fmt.Sprintf(`{"id":%q,"amount":1}`, id),
		header: map[string]string{"X-Key": id, "Stripe-Signature": "ok"}}
	first, again := send(t, srv, event), send(t, srv, event)
	if first.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || runs != 1 {
		t.Fatalf("%d, then %d %v after %d runs", first.status, again.status, again.header, runs)
	}
	if rec, err := Lookup(ctx, pool, "webhook:stripe", id); rec == nil || err != nil {
		t.Fatalf("no record of the body's id: %v", err)
	}
	forged := event
	forged.header = map[string]string{"X-Key": id}
	wantProblem(t, send(t, srv, forged), 401, CodeWebhookUnverified)
	wantProblem(t, send(t, srv, call{path: "/webhooks", body: `{"amount":1}`,
		header: map[string]string{"Stripe-Signature": "ok"}}), 400, CodeKeyMissing)
	if runs != 1 {
		t.Fatalf("%d runs", runs)
	}
}

// Redact changes what is stored, not what the first client gets: a replay
// sends what was stored.
func TestMiddlewareRedact(t *testing.T) {
	var runs, redacted int32
	srv := serve(t, pool, Options{Redact: func(status int, header http.Header, body []byte) (http.Header, []byte) {
		atomic.AddInt32(&redacted, 1)
		header.Set("Location", "/payments/redacted")
		return header, bytes.ReplaceAll(body, []byte(`"echo"`), []byte(`"redacted"`))
	}}, charge(&runs))
	c := keyed(uniqueKey(t), `{"card":"4242"}`)
	first := send(t, srv, c)
	if first.status != 201 || !bytes.Contains(first.body, []byte(`"echo"`)) || first.header.Get("Location") != "/payments/1" {
		t.Fatalf("the live response: %d %v %s", first.status, first.header, first.body)
	}
	again := send(t, srv, c)
	if again.status != 201 || bytes.Contains(again.body, []byte(`"echo"`)) || !bytes.Contains(again.body, []byte(`"redacted"`)) ||
		again.header.Get("Location") != "/payments/redacted" || runs != 1 || redacted != 1 {
		t.Fatalf("the replay: %d %v %q after %d runs, %d redactions", again.status, again.header, again.body, runs, redacted)
	}
}

// A Redact that panics: 500 idempotency_redact_failed, nothing stored, the
// handler's writes rolled back, the key free for the retry.
func TestMiddlewareRedactPanics(t *testing.T) {
	var runs int32
	var fail atomic.Bool
	fail.Store(true)
	srv := serve(t, pool, Options{Redact: func(status int, header http.Header, body []byte) (http.Header, []byte) {
		if fail.Load() {
			panic("no card number to mask")
		}
		return header, body
	}}, charge(&runs))
	key := uniqueKey(t)
	c := keyed(key, `{"card":"4242"}`)
	wantProblem(t, send(t, srv, c), 500, CodeRedactFailed)
	wantNothingKept(t, key)
	fail.Store(false)
	if again := send(t, srv, c); again.status != 201 || runs != 2 {
		t.Fatalf("the retry: %d after %d runs", again.status, runs)
	}
}
