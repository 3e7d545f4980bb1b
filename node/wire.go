package node

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
)

// Hop headers (docs/protocol.md).
const (
	HeaderSession     = "X-Meshnet-Session"
	HeaderShape       = "X-Meshnet-Shape"
	HeaderDType       = "X-Meshnet-Dtype"
	HeaderStartLayer  = "X-Meshnet-Start-Layer"
	HeaderEndLayer    = "X-Meshnet-End-Layer"
	HeaderPosition    = "X-Meshnet-Position"
	HeaderRoute       = "X-Meshnet-Route"
	HeaderSampling    = "X-Meshnet-Sampling"
	HeaderHopDeadline = "X-Meshnet-Hop-Deadline"
)

// Limits on what a hop header may carry. A route longer than maxRouteHops or
// a header longer than maxRouteBytes is hostile, not a big model.
const (
	maxSessionIDLen  = 128
	maxRouteHops     = 64
	maxRouteBytes    = 16 << 10
	maxSamplingBytes = 64 << 10
	maxLayerIndex    = 1 << 16
)

// Hop is one node of a route: run layers StartLayer..EndLayer there.
// Endpoint is the node's base URL ("http://127.0.0.1:7002"); it may be empty
// for a relay-only node, which then needs RelayAddr
// ("ws://relay:7000/rpc/{peer_id}").
type Hop struct {
	Endpoint   string `json:"endpoint"`
	StartLayer int    `json:"start_layer"`
	EndLayer   int    `json:"end_layer"`
	RelayAddr  string `json:"relay_addr,omitempty"`
	PeerID     string `json:"peer_id,omitempty"`
}

// Name is how errors name the hop: its endpoint, else its peer id.
func (h Hop) Name() string {
	if h.Endpoint != "" {
		return h.Endpoint
	}
	if h.PeerID != "" {
		return h.PeerID
	}
	return h.RelayAddr
}

// Sampling is the X-Meshnet-Sampling header: the sampler parameters plus the
// index of the token being generated. Tokens holds the ids fed at this hop's
// positions (Position..Position+n-1); the head sends them only when a
// repetition penalty is active, so the node with the last layer can keep the
// penalty history (prompt + generated ids) without ever seeing token ids
// otherwise. A retried hop resends the same ids; the history is truncated to
// Position first, so retries are idempotent.
type Sampling struct {
	sample.Params
	Step   int     `json:"step"`
	Tokens []int32 `json:"tokens,omitempty"`
}

// hopRequest is a parsed and validated POST /forward.
type hopRequest struct {
	session     string
	nTokens     int
	hidden      int
	dtype       native.DType
	start, end  int
	pos         int
	route       []Hop
	sampling    Sampling
	deadline    time.Time // zero: none
	samplingRaw string
}

// ValidSessionID reports whether id is 1–128 chars of [A-Za-z0-9._:-].
func ValidSessionID(id string) bool {
	if len(id) == 0 || len(id) > maxSessionIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == ':', c == '-':
		default:
			return false
		}
	}
	return true
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
		return 0, headerError(name, "want a non-negative integer, got %q", truncate(v, 40))
	}
	return n, nil
}

// ParseShape reads "n_tokens,hidden".
func ParseShape(v string) (n, hidden int, err error) {
	a, b, ok := strings.Cut(v, ",")
	if !ok {
		return 0, 0, fmt.Errorf("want n_tokens,hidden, got %q", truncate(v, 40))
	}
	n, err1 := strconv.Atoi(strings.TrimSpace(a))
	hidden, err2 := strconv.Atoi(strings.TrimSpace(b))
	if err1 != nil || err2 != nil || n < 1 || hidden < 1 || n > 1<<24 || hidden > 1<<20 {
		return 0, 0, fmt.Errorf("want two positive integers n_tokens,hidden, got %q", truncate(v, 40))
	}
	return n, hidden, nil
}

// ParseRoute decodes and checks a route: at most maxRouteHops hops, each with
// a usable address and start <= end, contiguous (each hop starts right after
// the previous one ends). numLayers > 0 also bounds the layers.
func ParseRoute(v string, numLayers int) ([]Hop, error) {
	if v == "" {
		return nil, nil
	}
	if len(v) > maxRouteBytes {
		return nil, fmt.Errorf("route is %d bytes, more than %d", len(v), maxRouteBytes)
	}
	dec := json.NewDecoder(strings.NewReader(v))
	var hops []Hop
	if err := dec.Decode(&hops); err != nil {
		return nil, fmt.Errorf("not a JSON list of hops: %v", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("trailing data after the JSON list")
	}
	if len(hops) > maxRouteHops {
		return nil, fmt.Errorf("%d hops, more than %d", len(hops), maxRouteHops)
	}
	for i, h := range hops {
		if err := h.validate(numLayers); err != nil {
			return nil, fmt.Errorf("hop %d: %v", i, err)
		}
		if i > 0 && h.StartLayer != hops[i-1].EndLayer+1 {
			return nil, fmt.Errorf("hop %d starts at layer %d, want %d (right after hop %d)", i, h.StartLayer, hops[i-1].EndLayer+1, i-1)
		}
	}
	return hops, nil
}

func (h Hop) validate(numLayers int) error {
	if h.Endpoint == "" && h.RelayAddr == "" {
		return fmt.Errorf("needs an endpoint or a relay_addr")
	}
	if h.Endpoint != "" {
		u, err := url.Parse(h.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || len(h.Endpoint) > 512 {
			return fmt.Errorf("endpoint %q is not an http(s) URL", truncate(h.Endpoint, 80))
		}
	}
	if h.RelayAddr != "" {
		u, err := url.Parse(h.RelayAddr)
		if err != nil || (u.Scheme != "ws" && u.Scheme != "wss") || u.Host == "" || len(h.RelayAddr) > 512 {
			return fmt.Errorf("relay_addr %q is not a ws(s) URL", truncate(h.RelayAddr, 80))
		}
	}
	if len(h.PeerID) > 256 {
		return fmt.Errorf("peer_id longer than 256 bytes")
	}
	if h.StartLayer < 0 || h.EndLayer < h.StartLayer || h.EndLayer > maxLayerIndex {
		return fmt.Errorf("layers %d-%d are not a range", h.StartLayer, h.EndLayer)
	}
	if numLayers > 0 && h.EndLayer >= numLayers {
		return fmt.Errorf("end_layer %d is beyond the model's %d layers", h.EndLayer, numLayers)
	}
	return nil
}

// ParseSampling decodes X-Meshnet-Sampling.
func ParseSampling(v string) (Sampling, error) {
	var s Sampling
	if len(v) > maxSamplingBytes {
		return s, fmt.Errorf("%d bytes, more than %d", len(v), maxSamplingBytes)
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return s, fmt.Errorf("not a JSON object of sampling parameters: %v", err)
	}
	if err := s.Params.Validate(); err != nil {
		return s, err
	}
	if s.Step < 0 {
		return s, fmt.Errorf("step %d is negative", s.Step)
	}
	return s, nil
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
	r.session = h.Get(HeaderSession)
	if !ValidSessionID(r.session) {
		return nil, headerError(HeaderSession, "want 1-%d characters of [A-Za-z0-9._:-]", maxSessionIDLen)
	}
	shape := h.Get(HeaderShape)
	if shape == "" {
		return nil, headerError(HeaderShape, "missing")
	}
	var err error
	if r.nTokens, r.hidden, err = ParseShape(shape); err != nil {
		return nil, headerError(HeaderShape, "%v", err)
	}
	if r.hidden != sh.hidden {
		return nil, headerError(HeaderShape, "hidden size %d, this model's is %d", r.hidden, sh.hidden)
	}
	r.dtype = native.BF16
	if v := h.Get(HeaderDType); v != "" {
		switch strings.ToLower(strings.TrimSpace(v)) {
		case "bf16":
			r.dtype = native.BF16
		case "f32":
			r.dtype = native.F32
		default:
			return nil, headerError(HeaderDType, "want bf16 or f32, got %q", truncate(v, 20))
		}
	}
	var ae *apiError
	if r.start, ae = parseInt(h, HeaderStartLayer, true, 0); ae != nil {
		return nil, ae
	}
	if r.start < sh.first || r.start > sh.last {
		return nil, headerError(HeaderStartLayer, "layer %d is outside this node's layers %d-%d", r.start, sh.first, sh.last)
	}
	if r.end, ae = parseInt(h, HeaderEndLayer, false, sh.last); ae != nil {
		return nil, ae
	}
	if r.end < r.start || r.end > sh.last {
		return nil, headerError(HeaderEndLayer, "layer %d is outside %d-%d (start layer to this node's last)", r.end, r.start, sh.last)
	}
	if r.pos, ae = parseInt(h, HeaderPosition, true, 0); ae != nil {
		return nil, ae
	}
	if sh.maxContext > 0 && r.pos+r.nTokens > sh.maxContext {
		return nil, &apiError{Status: http.StatusInsufficientStorage, Type: "context_full",
			Message: fmt.Sprintf("positions %d..%d exceed this node's context of %d tokens", r.pos, r.pos+r.nTokens-1, sh.maxContext)}
	}
	if r.route, err = ParseRoute(h.Get(HeaderRoute), sh.numLayers); err != nil {
		return nil, headerError(HeaderRoute, "%v", err)
	}
	if len(r.route) > 0 && r.route[0].StartLayer != r.end+1 {
		return nil, headerError(HeaderRoute, "first hop starts at layer %d, but this hop ends at layer %d", r.route[0].StartLayer, r.end)
	}
	if r.end == sh.numLayers-1 && !sh.hasHead {
		return nil, headerError(HeaderEndLayer, "this node does not hold the LM head")
	}
	if v := h.Get(HeaderSampling); v != "" {
		if r.sampling, err = ParseSampling(v); err != nil {
			return nil, headerError(HeaderSampling, "%v", err)
		}
		if n := len(r.sampling.Tokens); n > 0 && n != r.nTokens {
			return nil, headerError(HeaderSampling, "tokens has %d ids for %d rows", n, r.nTokens)
		}
		r.samplingRaw = v
	}
	if v := h.Get(HeaderHopDeadline); v != "" {
		ms, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil || ms <= 0 {
			return nil, headerError(HeaderHopDeadline, "want unix milliseconds, got %q", truncate(v, 30))
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

// TokenReply is the last-hop decode: the sampled token, and its model
// logprobs when the sampling parameters ask for them.
type TokenReply struct {
	Token    int32                 `json:"token"`
	Text     string                `json:"text"`
	Logprob  float32               `json:"logprob"`
	Logprobs *sample.TokenLogprobs `json:"logprobs,omitempty"`
}
