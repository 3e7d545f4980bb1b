package node

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// hopRequest is one validated hop, from POST /forward (every field in its
// headers) or a Hop frame (the per-token head; start, end, route and params
// come from the session's binding: the frame's own, or the one stored).
type hopRequest struct {
	session  string
	nTokens  int
	hidden   int
	dtype    native.DType
	pos      int
	step     int
	tokens   []int32   // ids at this hop's positions (repetition penalty or verify)
	deadline time.Time // zero: none
	// verify: the tokens are the last accepted token and drafts; the node
	// with the last layer answers the accepted ones plus one.
	verify bool
	// pass orders a pass sent while earlier ones are in flight (zero:
	// unordered; node/inflight.go).
	pass wire.PassOrder
	// parents: a verify hop's token tree; keep: cache slots to move to
	// pos-len(keep).. before the hop runs (wire/tree.go). Hop frames only.
	parents, keep []int32

	// What the session's binding fixes; set when bound is true.
	bound      bool
	start, end int
	route      []wire.Hop
	params     sample.Params
	ticket     []byte
	// rebind: this hop brought its binding (POST /forward always does), so
	// it is stored and passed on down the chain.
	rebind bool
}

// binding is what a Hop frame would carry to bind req's session.
func (r *hopRequest) binding() *wire.Binding {
	return &wire.Binding{StartLayer: r.start, EndLayer: r.end, Route: r.route, Sampling: r.params, Ticket: r.ticket}
}

// bind takes start, end, route and params from b, validated against the shard.
func (r *hopRequest) bind(b *wire.Binding, sh shardInfo) *apiError {
	if b.StartLayer < sh.first || b.StartLayer > sh.last {
		return bindingError("start layer %d is outside this node's layers %d-%d", b.StartLayer, sh.first, sh.last)
	}
	if b.EndLayer < b.StartLayer || b.EndLayer > sh.last {
		return bindingError("end layer %d is outside %d-%d (start layer to this node's last)", b.EndLayer, b.StartLayer, sh.last)
	}
	if err := wire.CheckRoute(b.Route, sh.numLayers); err != nil {
		return bindingError("route: %v", err)
	}
	if len(b.Route) > 0 && b.Route[0].StartLayer != b.EndLayer+1 {
		return bindingError("route: first hop starts at layer %d, but this hop ends at layer %d", b.Route[0].StartLayer, b.EndLayer)
	}
	if b.EndLayer == sh.numLayers-1 && !sh.hasHead {
		return bindingError("end layer %d: this node does not hold the LM head", b.EndLayer)
	}
	if err := b.Sampling.Validate(); err != nil {
		return bindingError("sampling: %v", err)
	}
	r.bound, r.start, r.end, r.route, r.params, r.ticket = true, b.StartLayer, b.EndLayer, b.Route, b.Sampling, b.Ticket
	return nil
}

func bindingError(format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_binding", Message: "session binding: " + fmt.Sprintf(format, args...)}
}

// errUnbound asks the sender to resend the hop with the session's binding.
func errUnbound(session string) *apiError {
	return &apiError{Status: http.StatusPreconditionRequired, Type: "binding_required",
		Message: "session " + session + " has no binding on this node; resend the hop with it"}
}

// frameHopRequest validates a Hop frame's head against the shard. An
// unbound head is completed from the session's stored binding later, under
// the session's lock.
func frameHopRequest(h *wire.HopHead, sh shardInfo) (*hopRequest, *apiError) {
	r := &hopRequest{session: h.Session, nTokens: h.NTokens, hidden: h.Hidden, pos: h.Position, step: h.Step,
		tokens: h.Tokens, deadline: h.Deadline, verify: h.Verify, pass: h.Pass, parents: h.Parents, keep: h.Keep}
	if h.Hidden != sh.hidden {
		return nil, headerError("hop head", "hidden size %d, this model's is %d", h.Hidden, sh.hidden)
	}
	switch h.DType {
	case wire.DTypeBF16:
		r.dtype = native.BF16
	case wire.DTypeF32:
		r.dtype = native.F32
	}
	if sh.maxContext > 0 && r.pos+r.nTokens > sh.maxContext {
		return nil, &apiError{Status: http.StatusInsufficientStorage, Type: "context_full",
			Message: fmt.Sprintf("positions %d..%d exceed this node's context of %d tokens", r.pos, r.pos+r.nTokens-1, sh.maxContext)}
	}
	if h.Binding != nil {
		if ae := r.bind(h.Binding, sh); ae != nil {
			return nil, ae
		}
		r.rebind = true
	}
	return r, nil
}

// wireDType is native dtype d on the wire.
func wireDType(d native.DType) uint8 {
	if d == native.F32 {
		return wire.DTypeF32
	}
	return wire.DTypeBF16
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
		smp, err := wire.ParseSampling(v)
		if err != nil {
			return nil, headerError(wire.HeaderSampling, "%v", err)
		}
		if n := len(smp.Tokens); n > 0 && n != r.nTokens {
			return nil, headerError(wire.HeaderSampling, "tokens has %d ids for %d rows", n, r.nTokens)
		}
		r.params, r.step, r.tokens = smp.SamplingParams, smp.Step, smp.Tokens
	}
	if v := h.Get(wire.HeaderTicket); v != "" {
		if r.ticket, err = ticket.FromString(v); err != nil || len(r.ticket) > wire.MaxTicketBytes {
			return nil, headerError(wire.HeaderTicket, "want a base64url route ticket pass of at most %d bytes", wire.MaxTicketBytes)
		}
	}
	if v := h.Get(wire.HeaderVerify); v != "" {
		if v != "1" {
			return nil, headerError(wire.HeaderVerify, "want 1, got %q", wire.Truncate(v, 20))
		}
		if len(r.tokens) != r.nTokens || r.nTokens > wire.MaxVerifyRows {
			return nil, headerError(wire.HeaderVerify, "a verify hop needs one token id per row in %s and at most %d rows, got %d ids for %d rows",
				wire.HeaderSampling, wire.MaxVerifyRows, len(r.tokens), r.nTokens)
		}
		r.verify = true
	}
	if v := h.Get(wire.HeaderPass); v != "" {
		if r.pass, err = wire.ParsePassOrder(v); err != nil {
			return nil, headerError(wire.HeaderPass, "%v", err)
		}
	}
	r.bound, r.rebind = true, true
	if v := h.Get(wire.HeaderHopDeadline); v != "" {
		ms, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil || ms <= 0 {
			return nil, headerError(wire.HeaderHopDeadline, "want unix milliseconds, got %q", wire.Truncate(v, 30))
		}
		r.deadline = time.UnixMilli(ms)
	}
	return r, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
