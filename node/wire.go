package node

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"meshgpu/native"
	"meshgpu/wire"
)

// hopRequest is a parsed and validated POST /forward.
type hopRequest struct {
	session     string
	nTokens     int
	hidden      int
	dtype       native.DType
	start, end  int
	pos         int
	route       []wire.Hop
	sampling    wire.Sampling
	deadline    time.Time // zero: none
	samplingRaw string
}

// headerError is a malformed header: a 400 naming the header.
func headerError(name, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_header",
		Message: name + ": " + fmt.Sprintf(format, args...)}
}

func parseInt(h http.Header, name string, required bool, def int) (int, *apiError) {
	v := h.Get(name)
	if v == "" {
		if required {
			return 0, headerError(name, "missing")
		}
		return def, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 || n > 1<<30 {
		return 0, headerError(name, "want a non-negative integer, got %q", wire.Truncate(v, 40))
	}
	return n, nil
}

// shardInfo is what hop validation needs to know about this node.
type shardInfo struct {
	first, last, numLayers, hidden int
	hasHead                        bool
	maxContext                     int
}

// parseHopRequest validates every header of a POST /forward against the shard.
func parseHopRequest(h http.Header, sh shardInfo) (*hopRequest, *apiError) {
	r := &hopRequest{}
	r.session = h.Get(wire.HeaderSession)
	if !wire.ValidSessionID(r.session) {
		return nil, headerError(wire.HeaderSession, "want 1-%d characters of [A-Za-z0-9._:-]", wire.MaxSessionIDLen)
	}
	shape := h.Get(wire.HeaderShape)
	if shape == "" {
		return nil, headerError(wire.HeaderShape, "missing")
	}
	var err error
	if r.nTokens, r.hidden, err = wire.ParseShape(shape); err != nil {
		return nil, headerError(wire.HeaderShape, "%v", err)
	}
	if r.hidden != sh.hidden {
		return nil, headerError(wire.HeaderShape, "hidden size %d, this model's is %d", r.hidden, sh.hidden)
	}
	r.dtype = native.BF16
	if v := h.Get(wire.HeaderDType); v != "" {
		switch strings.ToLower(strings.TrimSpace(v)) {
		case "bf16":
			r.dtype = native.BF16
		case "f32":
			r.dtype = native.F32
		default:
			return nil, headerError(wire.HeaderDType, "want bf16 or f32, got %q", wire.Truncate(v, 20))
		}
	}
	var ae *apiError
	if r.start, ae = parseInt(h, wire.HeaderStartLayer, true, 0); ae != nil {
		return nil, ae
	}
	if r.start < sh.first || r.start > sh.last {
		return nil, headerError(wire.HeaderStartLayer, "layer %d is outside this node's layers %d-%d", r.start, sh.first, sh.last)
	}
	if r.end, ae = parseInt(h, wire.HeaderEndLayer, false, sh.last); ae != nil {
		return nil, ae
	}
	if r.end < r.start || r.end > sh.last {
		return nil, headerError(wire.HeaderEndLayer, "layer %d is outside %d-%d (start layer to this node's last)", r.end, r.start, sh.last)
	}
	if r.pos, ae = parseInt(h, wire.HeaderPosition, true, 0); ae != nil {
		return nil, ae
	}
	if sh.maxContext > 0 && r.pos+r.nTokens > sh.maxContext {
		return nil, &apiError{Status: http.StatusInsufficientStorage, Type: "context_full",
			Message: fmt.Sprintf("positions %d..%d exceed this node's context of %d tokens", r.pos, r.pos+r.nTokens-1, sh.maxContext)}
	}
	if r.route, err = wire.ParseRoute(h.Get(wire.HeaderRoute), sh.numLayers); err != nil {
		return nil, headerError(wire.HeaderRoute, "%v", err)
	}
	if len(r.route) > 0 && r.route[0].StartLayer != r.end+1 {
		return nil, headerError(wire.HeaderRoute, "first hop starts at layer %d, but this hop ends at layer %d", r.route[0].StartLayer, r.end)
	}
	if r.end == sh.numLayers-1 && !sh.hasHead {
		return nil, headerError(wire.HeaderEndLayer, "this node does not hold the LM head")
	}
	if v := h.Get(wire.HeaderSampling); v != "" {
		if r.sampling, err = wire.ParseSampling(v); err != nil {
			return nil, headerError(wire.HeaderSampling, "%v", err)
		}
		if n := len(r.sampling.Tokens); n > 0 && n != r.nTokens {
			return nil, headerError(wire.HeaderSampling, "tokens has %d ids for %d rows", n, r.nTokens)
		}
		r.samplingRaw = v
	}
	if v := h.Get(wire.HeaderHopDeadline); v != "" {
		ms, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil || ms <= 0 {
			return nil, headerError(wire.HeaderHopDeadline, "want unix milliseconds, got %q", wire.Truncate(v, 30))
		}
		r.deadline = time.UnixMilli(ms)
	}
	return r, nil
}
