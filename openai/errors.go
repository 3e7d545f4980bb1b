package openai

import (
	"fmt"
	"net/http"

	"meshgpu/wire"
)

// The error bodies of the API are wire.Error (one shape for hops, relays and
// the API: {"error":{"message","type","param","code","hop"}}); here are the
// API's own.

// ModelNotFound is OpenAI's answer for a model this server does not serve.
func ModelNotFound(model string) *wire.Error {
	return &wire.Error{Status: http.StatusNotFound, Type: wire.TypeInvalidRequest, Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("the model %q does not exist or is not served here", model)}
}
