package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"meshgpu/wire"
)

// apiError is every error this server returns, as
// {"error":{"message","type","hop"}} with an HTTP status. OpenAI endpoints
// use the same body (their clients read message and type).
type apiError struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Hop     string `json:"hop,omitempty"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
	// RetryAfter (seconds) goes out as the Retry-After header of a
	// back-pressure answer.
	RetryAfter int `json:"-"`

	transport bool // set by a sender for its own transport failure or timeout: worth a retry
}

func (e *apiError) Error() string {
	if e.Hop != "" {
		return fmt.Sprintf("%s (hop %s)", e.Message, e.Hop)
	}
	return e.Message
}

// errorBody is the JSON envelope of an error response (wire's one shape).
type errorBody = wire.ErrorBody

// wire is e as the error body every meshgpu server writes.
func (e *apiError) wire() *wire.Error {
	return &wire.Error{Status: e.Status, Message: e.Message, Type: e.Type, Param: e.Param, Code: e.Code, Hop: e.Hop, RetryAfter: e.RetryAfter}
}

// fromWire is a wire error as an apiError.
func fromWire(e *wire.Error) *apiError {
	return &apiError{Status: e.Status, Message: e.Message, Type: e.Type, Param: e.Param, Code: e.Code, Hop: e.Hop, RetryAfter: e.RetryAfter}
}

func writeError(w http.ResponseWriter, e *apiError) { wire.WriteError(w, e.wire()) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, &apiError{Status: 500, Type: "internal_error", Message: err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

func badRequest(format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: fmt.Sprintf(format, args...)}
}

// asAPIError maps any error to an apiError (500 unless it already is one).
func asAPIError(err error) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	return &apiError{Status: http.StatusInternalServerError, Type: "internal_error", Message: err.Error()}
}

// decodeErrorBody reads a downstream error body; a body that is not our JSON
// shape becomes a 502 naming the hop.
func decodeErrorBody(status int, body []byte, hop string) *apiError {
	if we, ok := wire.DecodeError(status, body); ok {
		e := fromWire(we)
		if e.Hop == "" {
			e.Hop = hop
		}
		return e
	}
	return &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop,
		Message: fmt.Sprintf("hop answered %d with a body that is not an error JSON: %q", status, wire.Truncate(string(body), 200))}
}
