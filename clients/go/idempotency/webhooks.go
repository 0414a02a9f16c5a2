package idempotency

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// WebhookVerifier checks a webhook delivery: its signature and timestamp.
// *standardwebhooks.Webhook of
// github.com/standard-webhooks/standard-webhooks/libraries/go is one.
type WebhookVerifier interface {
	Verify(payload []byte, headers http.Header) error
}

// StandardWebhook returns the Options of a Standard Webhooks receiver
// (https://www.standardwebhooks.com): each delivery is verified by v before
// anything is claimed, its key is the webhook-id header and its scope
// "webhook:" and the sender. Set the other Options on what it returns.
func StandardWebhook(v WebhookVerifier, sender string) Options {
	return Options{
		Methods: []string{http.MethodPost},
		Scope:   senderScope(sender),
		Key: func(r *http.Request, body []byte) (string, error) {
			if err := v.Verify(body, r.Header); err != nil {
				return "", fmt.Errorf("the webhook delivery could not be verified: %w", err)
			}
			id := r.Header.Get("webhook-id")
			if id == "" {
				return "", errors.New("the webhook delivery has no webhook-id")
			}
			return id, nil
		},
	}
}

// BodyKey returns the Options of a receiver whose sender keeps its event id
// in a string field of the JSON body (Stripe's "id"): verify checks the
// delivery (the sender's signature) before anything is claimed (else 401); a
// verified body without that field is a 400; the scope is "webhook:" and the
// sender.
func BodyKey(field string, verify func(r *http.Request, body []byte) error, sender string) Options {
	return Options{
		Methods: []string{http.MethodPost},
		Scope:   senderScope(sender),
		Key: func(r *http.Request, body []byte) (string, error) {
			if err := verify(r, body); err != nil {
				return "", fmt.Errorf("the webhook delivery could not be verified: %w", err)
			}
			var event map[string]json.RawMessage
			var id string
			if json.Unmarshal(body, &event) != nil || json.Unmarshal(event[field], &id) != nil || id == "" {
				return "", &noKeyError{fmt.Sprintf("the webhook delivery has no string %q in its body", field)}
			}
			return id, nil
		},
	}
}

// noKeyError is a verified delivery without its key: a 400, not a 401.
type noKeyError struct{ msg string }

func (e *noKeyError) Error() string { return e.msg }

// senderScope scopes every delivery to its sender.
func senderScope(sender string) func(*http.Request) string {
	return func(*http.Request) string { return "webhook:" + sender }
}
