package wire

import (
	"encoding/json"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
)

// Hop headers of POST /forward (docs/protocol.md), the v1 hop and the
// fallback for nodes that do not speak hop frames.
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

// Limits on what a hop may carry. A route longer than MaxRouteHops or
// MaxRouteBytes is hostile, not a big model.
const (
	MaxSessionIDLen  = 128
	MaxRouteHops     = 64
	MaxRouteBytes    = 16 << 10
	MaxSamplingBytes = 64 << 10
	MaxLayerIndex    = 1 << 16
	MaxHopTokens     = 1 << 24 // rows of one hop
	MaxHidden        = 1 << 20
	MaxPosition      = 1 << 30
	maxAddrLen       = 512
	maxPeerIDLen     = 256
)

// Hop is one node of a route: run layers StartLayer..EndLayer there. Its
// JSON is an element of X-Meshnet-Route and of a session binding's route.
// Endpoint is the node's base URL ("http://127.0.0.1:7002"); it may be
// empty for a relay-only node, which then needs RelayAddr
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

// Validate checks one hop: a usable address, start <= end, and, when
// numLayers > 0, within the model.
func (h Hop) Validate(numLayers int) error {
	if h.Endpoint == "" && h.RelayAddr == "" {
		return fmt.Errorf("needs an endpoint or a relay_addr")
	}
	if h.Endpoint != "" {
		u, err := url.Parse(h.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || len(h.Endpoint) > maxAddrLen {
			return fmt.Errorf("endpoint %q is not an http(s) URL", Truncate(h.Endpoint, 80))
		}
	}
	if h.RelayAddr != "" {
		u, err := url.Parse(h.RelayAddr)
		if err != nil || (u.Scheme != "ws" && u.Scheme != "wss") || u.Host == "" || len(h.RelayAddr) > maxAddrLen {
			return fmt.Errorf("relay_addr %q is not a ws(s) URL", Truncate(h.RelayAddr, 80))
		}
	}
	if len(h.PeerID) > maxPeerIDLen {
		return fmt.Errorf("peer_id longer than %d bytes", maxPeerIDLen)
	}
	if h.StartLayer < 0 || h.EndLayer < h.StartLayer || h.EndLayer > MaxLayerIndex {
		return fmt.Errorf("layers %d-%d are not a range", h.StartLayer, h.EndLayer)
	}
	if numLayers > 0 && h.EndLayer >= numLayers {
		return fmt.Errorf("end_layer %d is beyond the model's %d layers", h.EndLayer, numLayers)
	}
	return nil
}

// ParseRoute decodes and checks a route: at most MaxRouteHops hops in
// MaxRouteBytes of JSON, each valid, contiguous (each hop starts right
// after the previous one ends). Unknown fields are ignored.
func ParseRoute(v string, numLayers int) ([]Hop, error) {
	if v == "" {
		return nil, nil
	}
	if len(v) > MaxRouteBytes {
		return nil, fmt.Errorf("route is %d bytes, more than %d", len(v), MaxRouteBytes)
	}
	dec := json.NewDecoder(strings.NewReader(v))
	var hops []Hop
	if err := dec.Decode(&hops); err != nil {
		return nil, fmt.Errorf("not a JSON list of hops: %v", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("trailing data after the JSON list")
	}
	if err := CheckRoute(hops, numLayers); err != nil {
		return nil, err
	}
	return hops, nil
}

// CheckRoute validates decoded hops as ParseRoute does.
func CheckRoute(hops []Hop, numLayers int) error {
	if len(hops) > MaxRouteHops {
		return fmt.Errorf("%d hops, more than %d", len(hops), MaxRouteHops)
	}
	for i, h := range hops {
		if err := h.Validate(numLayers); err != nil {
			return fmt.Errorf("hop %d: %v", i, err)
		}
		if i > 0 && h.StartLayer != hops[i-1].EndLayer+1 {
			return fmt.Errorf("hop %d starts at layer %d, want %d (right after hop %d)", i, h.StartLayer, hops[i-1].EndLayer+1, i-1)
		}
	}
	return nil
}

// Sampling is the X-Meshnet-Sampling header: the sampler parameters plus
// the index of the token being generated. Tokens holds the ids fed at this
// hop's positions (Position..Position+n-1); the head sends them only when a
// repetition penalty is active, so the node with the last layer can keep
// the penalty history (prompt + generated ids) without ever seeing token
// ids otherwise. A retried hop resends the same ids; the history is
// truncated to Position first, so retries are idempotent.
type Sampling struct {
	SamplingParams
	Step   int     `json:"step"`
	Tokens []int32 `json:"tokens,omitempty"`
}

// ParseSampling decodes X-Meshnet-Sampling.
func ParseSampling(v string) (Sampling, error) {
	var s Sampling
	if len(v) > MaxSamplingBytes {
		return s, fmt.Errorf("%d bytes, more than %d", len(v), MaxSamplingBytes)
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return s, fmt.Errorf("not a JSON object of sampling parameters: %v", err)
	}
	if err := s.SamplingParams.Validate(); err != nil {
		return s, err
	}
	if s.Step < 0 {
		return s, fmt.Errorf("step %d is negative", s.Step)
	}
	return s, nil
}

// ValidSessionID reports whether id is 1–128 chars of [A-Za-z0-9._:-].
func ValidSessionID(id string) bool {
	if len(id) == 0 || len(id) > MaxSessionIDLen {
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

// ParseShape reads X-Meshnet-Shape: "n_tokens,hidden".
func ParseShape(v string) (n, hidden int, err error) {
	a, b, ok := strings.Cut(v, ",")
	if !ok {
		return 0, 0, fmt.Errorf("want n_tokens,hidden, got %q", Truncate(v, 40))
	}
	n, err1 := strconv.Atoi(strings.TrimSpace(a))
	hidden, err2 := strconv.Atoi(strings.TrimSpace(b))
	if err1 != nil || err2 != nil || n < 1 || hidden < 1 || n > MaxHopTokens || hidden > MaxHidden {
		return 0, 0, fmt.Errorf("want two positive integers n_tokens,hidden, got %q", Truncate(v, 40))
	}
	return n, hidden, nil
}

// Truncate shortens s to n bytes for an error message.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// TokenReply is the last hop's answer: the sampled token and its
// log-probability. The head turns ids into text itself (a UTF-8-safe
// stream decoder), so no text travels.
type TokenReply struct {
	Token   int32   `json:"token"`
	Logprob float32 `json:"logprob"`
	// Logprobs, when the sampling parameters ask for them.
	Logprobs *TokenLogprobs `json:"logprobs,omitempty"`
}

// logprobSlack admits a sampler's float rounding above 0 in a
// log-probability (a log-softmax is at most 0).
const logprobSlack = 1e-3

// Check reports the first value in t that no sampler produces for a model
// with vocab tokens: an id outside the vocabulary, more than
// MaxTopLogprobs alternatives, a log-probability that is NaN, infinite or
// above 0. Such a reply is its sender's fault, and none of it may reach a
// client (JSON cannot even encode NaN).
func (t *TokenReply) Check(vocab int) error {
	bad := func(v float32) bool { return v != v || v > logprobSlack || v < -math.MaxFloat32 }
	switch {
	case t.Token < 0 || int(t.Token) >= vocab:
		return fmt.Errorf("token %d is outside the vocabulary of %d", t.Token, vocab)
	case bad(t.Logprob):
		return fmt.Errorf("token %d has logprob %v, not a log-probability", t.Token, t.Logprob)
	case t.Logprobs == nil:
		return nil
	case bad(t.Logprobs.Logprob):
		return fmt.Errorf("token %d has model logprob %v, not a log-probability", t.Token, t.Logprobs.Logprob)
	case len(t.Logprobs.Top) > MaxTopLogprobs:
		return fmt.Errorf("%d top logprobs, at most %d", len(t.Logprobs.Top), MaxTopLogprobs)
	}
	for _, c := range t.Logprobs.Top {
		if c.ID < 0 || int(c.ID) >= vocab || bad(c.Logprob) {
			return fmt.Errorf("top logprob of token %d is %v: not a token of the vocabulary of %d with a log-probability", c.ID, c.Logprob, vocab)
		}
	}
	return nil
}

// Candidate is one alternative token and its log-probability.
type Candidate struct {
	ID      int32   `json:"id"`
	Logprob float32 `json:"logprob"`
}

// TokenLogprobs is what a sampling node reports for SamplingParams.Logprobs:
// the chosen token's log-probability under the model's distribution (the
// log-softmax of the penalized logits, before temperature and filters, as
// vLLM and OpenAI report) and the TopLogprobs most likely tokens, most
// likely first (ties by id).
type TokenLogprobs struct {
	Logprob float32     `json:"logprob"`
	Top     []Candidate `json:"top,omitempty"`
}
