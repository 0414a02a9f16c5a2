package idempotency

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
)

// recorder holds what a handler answers until its transaction has ended.
type recorder struct {
	header http.Header
	status int // 0 until WriteHeader or the first Write
	body   bytes.Buffer
	stored *completion // what complete was given to store, once it was
}

// newRecorder starts an empty response.
func newRecorder() *recorder {
	return &recorder{header: make(http.Header)}
}

// Header is the header the handler sets.
func (r *recorder) Header() http.Header { return r.header }

// WriteHeader keeps the first final status, as net/http does. An
// informational (1xx) one is dropped: it cannot be held back, nor replayed.
func (r *recorder) WriteHeader(status int) {
	if r.status == 0 && status >= 200 {
		r.status = status
	}
}

// Write buffers the body (an implicit 200 if no status was set).
func (r *recorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(p)
}

// finish settles what net/http would have settled on the first write: the
// status (200 if none) and a sniffed Content-Type, so that the response
// stored is the one sent.
func (r *recorder) finish() {
	r.WriteHeader(http.StatusOK)
	_, typed := r.header["Content-Type"]
	if !typed && r.body.Len() > 0 && bodyAllowed(r.status) && r.header.Get("Transfer-Encoding") == "" {
		r.header.Set("Content-Type", http.DetectContentType(r.body.Bytes()))
	}
}

// sendTo writes the held response to w.
func (r *recorder) sendTo(w http.ResponseWriter) {
	copyHeader(w.Header(), r.header)
	w.WriteHeader(r.status)
	w.Write(r.body.Bytes())
}

// bodyAllowed reports whether a response with this status may have a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// copyHeader adds every field of src to dst.
func copyHeader(dst, src http.Header) {
	for name, values := range src {
		dst[name] = append(dst[name], values...)
	}
}

// replay sends a stored response again, marked Idempotent-Replayed.
func replay(w http.ResponseWriter, t *Ticket) {
	copyHeader(w.Header(), t.Header)
	w.Header().Set("Idempotent-Replayed", "true")
	w.WriteHeader(t.StatusCode)
	w.Write(t.Body)
}

// The codes of the problems the middleware answers (docs/http-contract.md).
const (
	CodeKeyMissing        = "idempotency_key_missing"
	CodeKeyInvalid        = "idempotency_key_invalid"
	CodeKeyInProgress     = "idempotency_key_in_progress"
	CodeKeyMismatch       = "idempotency_key_mismatch"
	CodeClaimLost         = "idempotency_claim_lost"
	CodeUnavailable       = "idempotency_unavailable"
	CodeBodyTooLarge      = "request_body_too_large"
	CodeBodyUnread        = "request_body_unreadable"
	CodeWebhookUnverified = "webhook_unverified"
	CodeRedactFailed      = "idempotency_redact_failed"
)

// titles are the reason phrases of RFC 9110, the titles of the problems.
var titles = map[int]string{
	http.StatusBadRequest:            "Bad Request",
	http.StatusUnauthorized:          "Unauthorized",
	http.StatusConflict:              "Conflict",
	http.StatusRequestEntityTooLarge: "Content Too Large",
	http.StatusUnprocessableEntity:   "Unprocessable Content",
	http.StatusInternalServerError:   "Internal Server Error",
	http.StatusServiceUnavailable:    "Service Unavailable",
}

// problem is an RFC 9457 problem with this project's code member.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Code   string `json:"code"`
}

// writeProblem answers status with a problem+json body; retryAfter > 0 adds
// Retry-After.
func writeProblem(w http.ResponseWriter, status int, code, detail string, retryAfter int) {
	body, _ := json.Marshal(problem{Type: "about:blank", Title: titles[status],
		Status: status, Detail: detail, Code: code})
	w.Header().Set("Content-Type", "application/problem+json")
	if retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
	}
	w.WriteHeader(status)
	w.Write(body)
}
