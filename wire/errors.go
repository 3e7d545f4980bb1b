package wire

import (
	"encoding/json"
	"fmt"
	"net/http"
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
}

func (e *Error) Error() string {
	if e.Hop != "" {
		return fmt.Sprintf("%s (hop %s)", e.Message, e.Hop)
	}
	return e.Message
}

// ErrorBody is the JSON envelope of an error response or SSE error event.
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

// Invalid is a 400 invalid_request_error naming param ("" for none).
func Invalid(param, format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Message: fmt.Sprintf(format, args...)}
}

// ModelNotFound is OpenAI's answer for a model this server does not serve.
func ModelNotFound(model string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("the model %q does not exist or is not served here", model)}
}

// WriteError writes e as the JSON error response.
func WriteError(w http.ResponseWriter, e *Error) {
	b, _ := json.Marshal(ErrorBody{Error: e})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
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
