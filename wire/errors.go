package wire

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// Error is every error body meshgpu answers (nodes, relays, the tracker),
// OpenAI's shape {"error":{"message","type","param","code"}} plus hop, the
// node that failed. Status is the HTTP status, not sent.
type Error struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
	Hop     string `json:"hop,omitempty"`
	// RetryAfter, in seconds, is sent as the Retry-After header of a
	// back-pressure answer (429, 503 busy); 0 sends none.
	RetryAfter int `json:"-"`
}

func (e *Error) Error() string {
	if e.Hop != "" {
		return fmt.Sprintf("%s (hop %s)", e.Message, e.Hop)
	}
	return e.Message
}

// ErrorBody is the JSON envelope of an error response, an error reply of a
// hop and the error event a failing stream ends with.
type ErrorBody struct {
	Error *Error `json:"error"`
}

// Error types (OpenAI's where one fits).
const (
	TypeInvalidRequest = "invalid_request_error"
	TypeNotFound       = "not_found_error"
	TypeServer         = "server_error"
	TypeUnavailable    = "service_unavailable"
)

// Path outages: the node is fine, the way to it is not. A tracker routes
// around such a node without banning it, and routes to it again once its
// heartbeat says its relay connection is back.
const (
	// TypeRelayUnreachable (502): a hop through a relay failed because the
	// relay is down or the peer is not connected to it; the message names
	// the relay.
	TypeRelayUnreachable = "relay_unreachable"
	// TypeRelayUnavailable (503): the tracker has no route because the
	// nodes that would cover some layers cannot be reached through their
	// relay.
	TypeRelayUnavailable = "relay_unavailable"
	// TypeTicketExpired (403): the session's route ticket has expired, so
	// the hop refuses it and frees the session; its issuer resumes the
	// generation on a new ticket (the tracker renews; not a failure of the
	// hop when the ticket has indeed expired).
	TypeTicketExpired = "ticket_expired"
)

// Back-pressure types: the server is healthy but full right now. A sender
// waits (Retry-After) or goes elsewhere; it never counts them as failures.
const (
	TypeQueueFull       = "queue_full"        // 429: the head's admission queue is full
	TypeQueueTimeout    = "queue_timeout"     // 429: no session slot came free within the queue wait
	TypeTooManySessions = "too_many_sessions" // 429: every session slot of a node is taken
	TypeOverloaded      = "overloaded"        // 429: a node serves its maximum of hops at once
	TypeRateLimited     = "rate_limited"      // 429: a relay's per-sender limit, or a relayed node's
	TypeBusy            = "busy"              // 503: no host buffer came free in time
	TypePeerBusy        = "peer_busy"         // 503: a relay's send queue to the peer is full
)

// Backpressure reports whether an error of this status and type says
// "busy, retry later" rather than "failed". A 429 always does; a 503 only
// with a busy type (a 503 not_ready or shutting_down is a failure).
func Backpressure(status int, typ string) bool {
	switch typ {
	case TypeQueueFull, TypeQueueTimeout, TypeTooManySessions, TypeOverloaded, TypeRateLimited, TypeBusy, TypePeerBusy:
		return true
	}
	return status == http.StatusTooManyRequests
}

// Invalid is a 400 invalid_request_error naming param ("" for none).
func Invalid(param, format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Message: fmt.Sprintf(format, args...)}
}

// WriteError writes e as the JSON error response.
func WriteError(w http.ResponseWriter, e *Error) {
	b, _ := json.Marshal(ErrorBody{Error: e})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	status := e.Status
	if status < 400 || status > 599 {
		status = http.StatusInternalServerError
	}
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

// DecodeError reads an error body; ok is false when b is not one.
func DecodeError(status int, b []byte) (e *Error, ok bool) {
	var eb ErrorBody
	if json.Unmarshal(b, &eb) != nil || eb.Error == nil || eb.Error.Message == "" {
		return nil, false
	}
	eb.Error.Status = status
	return eb.Error, true
}
