package node

import (
	"net/http"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// A hostile head's response_format reaches the sampling node: a schema it
// cannot honour, a format that is not one, or a history too short for the
// step is a 400 naming the problem, and the node keeps sampling.
func TestHostileResponseFormatOnTheTail(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, urls := fakeMesh(t, nil)
	c := &http.Client{}
	defer c.CloseIdleConnections()
	tail := hopReq{session: "fmt", n: 1, hidden: fkHidden, dtype: native.BF16, start: 5, end: -1, pos: 0}
	for _, tc := range []struct{ sampling, want string }{
		{`{"step":0,"temperature":0,"tokens":[1],"response_format":{"type":"json_schema","schema":{"anyOf":[{"type":"string"}]}}}`, "anyOf"},
		{`{"step":0,"temperature":0,"tokens":[1],"response_format":"json"}`, "response_format"},
		{`{"step":0,"temperature":0,"tokens":[1],"response_format":{"type":"json_schema","schema":` + strings.Repeat(`{"items":`, 40) + `{}` + strings.Repeat(`}`, 40) + `}}`, "nested"},
		{`{"step":5,"temperature":0,"tokens":[1],"response_format":{"type":"json_object"}}`, "history"},
	} {
		h := tail
		h.sampling = tc.sampling
		status, hdr, b := h.send(t, c, urls[2])
		if status != 400 {
			t.Errorf("%s: %d %s", tc.sampling, status, b)
			continue
		}
		if e := decodeError(t, status, hdr, b); !strings.Contains(e.Message, tc.want) {
			t.Errorf("%s: %q does not name %q", tc.sampling, e.Message, tc.want)
		}
	}
	h := tail
	h.sampling = `{"step":0,"temperature":0}`
	if status, _, b := h.send(t, c, urls[2]); status != 200 {
		t.Errorf("a plain hop after the hostile ones: %d %s", status, b)
	}
}
