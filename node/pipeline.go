package node

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/sched"
	"meshgpu/wire"
)

// pipeline drives one generation from the head: each step embeds the
// tokens, runs the head's layers 0..headEnd on its own KV cache, then sends
// one hop to route[0] carrying route[1:] (chain mode) and reads back the
// sampled token. A head holding every layer samples locally.
type pipeline struct {
	s       *Server
	sess    *session // the head's KV cache, locked for the whole generation
	id      string
	headEnd int
	route   []wire.Hop
	ticket  []byte // the route ticket's pass for route[0] (node/tickets.go); nil: unticketed
	params  sample.Params
	dtype   native.DType // activations in the head's own Forward and on the hop

	// logprobs holds each sampled token's logprobs, in step order, when
	// params.Logprobs asks for them.
	logprobs     []sample.TokenLogprobs
	stepLogprobs *sample.TokenLogprobs // of the last step
	start        time.Time             // the request's arrival, for time to first token
	last         time.Time             // the previous token, for the inter-token latency
	spec         *speculation          // nil: one token per pass
	// busyUntil is how long a hop answering back-pressure (a tail with
	// every session slot taken) is waited for and sent again; zero: the
	// busy answer goes back to whoever routed (a tracker goes elsewhere).
	busyUntil time.Time
	// direct is the tail's session key when the tail also sends its
	// answers straight to this head (node/directreply.go); nil: chain
	// answers only. chains are the chain sends of passes the head went on
	// from with the direct reply (several at once with passes in flight).
	direct []byte
	chains chainSet
}

// busyUntil is the time a generation of j may wait behind busy hops: on
// the operator's route, the head's own queue wait from the request's
// arrival, as if the request had queued at the head (no tracker routes
// around the busy node). A tracker's route waits for nothing here.
func (s *Server) busyUntil(j *job) time.Time {
	if j.grant == nil || !j.grant.static {
		return time.Time{}
	}
	return j.arrived.Add(s.QueueWait)
}

// Waits between tries of a busy hop: a slot frees at the pace of tokens.
const (
	busyRetryFirst = 20 * time.Millisecond
	busyRetryMax   = 500 * time.Millisecond
)

// sendWaiting is sendHop that, until p.busyUntil, waits out a hop's
// back-pressure and sends the hop again (the same position: a redo for the
// nodes that ran it). Past busyUntil the client gets the head's own 429,
// naming no hop: the node is busy, not failed.
func (p *pipeline) sendWaiting(ctx context.Context, call hopCall, buf []byte) (*hopAnswer, *apiError) {
	wait := busyRetryFirst
	for {
		res, ae := p.s.sendHop(ctx, p.route[0], p.route[1:], call, buf, time.Time{})
		if ae == nil || p.busyUntil.IsZero() || !wire.Backpressure(ae.Status, ae.Type) {
			return res, ae
		}
		left := time.Until(p.busyUntil)
		if left <= 0 {
			return nil, &apiError{Status: http.StatusTooManyRequests, Type: wire.TypeQueueTimeout, RetryAfter: retryAfterSeconds,
				Message: fmt.Sprintf("the route stayed busy for the head's queue wait of %v (%s: %s); retry later", p.s.QueueWait, ae.Hop, ae.Message)}
		}
		t := time.NewTimer(min(wait, left))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled while the route was busy"}
		}
		wait = min(2*wait, busyRetryMax)
	}
}

func (p *pipeline) local() bool { return len(p.route) == 0 }

// stepper is the engine.Stepper of the pipeline.
func (p *pipeline) stepper() engine.Stepper {
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		id, lp, ae := p.step(ctx, pos, tokens, step)
		if ae != nil {
			return 0, 0, ae
		}
		if p.params.Logprobs {
			lps := p.stepLogprobs
			if lps == nil {
				return 0, 0, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: p.route[0].Name(),
					Message: "the last hop sent no logprobs although they were asked for"}
			}
			p.logprobs = append(p.logprobs, *lps)
		}
		p.tokenArrived()
		return id, lp, nil
	}
}

// tokenArrived records a generated token's time to first token or
// inter-token latency (the tokens of one speculative pass arrive at once).
func (p *pipeline) tokenArrived() {
	now := time.Now()
	if p.last.IsZero() {
		p.s.metrics.firstToken(now.Sub(p.start))
	} else {
		p.s.metrics.interToken(now.Sub(p.last))
	}
	p.last = now
	p.s.metrics.tokenGenerated()
}

// step is one plain pass: the sampled token after tokens; its logprobs,
// when asked for, are left in p.stepLogprobs.
func (p *pipeline) step(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, *apiError) {
	p.stepLogprobs = nil
	toks, ae := p.pass(ctx, pos, tokens, step, false)
	if ae != nil {
		return 0, 0, ae
	}
	p.stepLogprobs = toks[0].Logprobs
	return toks[0].Token, toks[0].Logprob, nil
}

// pass runs tokens at pos..pos+len(tokens)-1 through the head's layers and
// the route, answering the sampled token, or (verify: tokens are the last
// accepted token and drafts) the accepted drafts plus one.
func (p *pipeline) pass(ctx context.Context, pos int, tokens []int32, step int, verify bool) ([]wire.TokenReply, *apiError) {
	hb, toks, ae := p.runHead(ctx, pos, tokens, step, verify)
	if hb == nil {
		return toks, ae
	}
	return p.sendPass(ctx, p.hopCall(pos, tokens, step, verify), hb)
}

// runHead runs a pass's tokens through the head's layers. Without a route
// it answers the pass (hb nil); else hb holds the activations to send,
// which the caller puts back.
func (p *pipeline) runHead(ctx context.Context, pos int, tokens []int32, step int, verify bool) (hb *hostBuf, local []wire.TokenReply, ae *apiError) {
	s := p.s
	if err := ctx.Err(); err != nil {
		return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + err.Error()}
	}
	n := len(tokens)
	if p.local() && !verify && p.spec.treeState().parents() == nil {
		if smp := s.backendSample(p.sess, p.params, pos, n, tokens, step); smp != nil {
			toks, ae := p.sampleLocal(ctx, pos, tokens, smp)
			return nil, toks, ae
		}
	}
	hidden := s.cfg.Hidden
	wait := time.Now().Add(s.HopTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(wait) {
		wait = d
	}
	hb, ae = s.hostBuffer(ctx, n*hidden*p.dtype.Size(), wait)
	if ae != nil {
		return nil, nil, ae
	}
	buf := hb.Bytes
	t0 := time.Now()
	var logits []float32
	if p.local() {
		rows := 1
		if verify {
			rows = n
		}
		logits = make([]float32, rows*s.cfg.Vocab)
	}
	tree := p.spec.treeState()
	if err := s.runTreeStage(ctx, p.sess.kv, 0, p.headEnd, pos, n, tokens, tree.parents(), p.dtype, buf, logits); err != nil {
		s.hosts.put(hb)
		return nil, nil, backendError(err)
	}
	p.sess.recordTokens(pos, tokens)
	p.sess.touch(time.Now())
	if !p.local() {
		s.metrics.computeDone(time.Since(t0))
		return hb, nil, nil
	}
	s.hosts.put(hb)
	defer func() { s.metrics.computeDone(time.Since(t0)) }()
	if verify {
		return nil, verifyPass(logits, s.cfg.Vocab, tokens, tree.parents(), p.params, p.sess, pos, step), nil
	}
	id, lp, lps, ae := s.sampleWithHistory(logits, p.params, p.sess, step)
	if ae != nil {
		return nil, nil, ae
	}
	return nil, []wire.TokenReply{{Token: id, Logprob: lp, Logprobs: lps}}, nil
}

// sampleLocal is runHead's plain step on a head holding every layer, whose
// token the backend samples (smp): the tokens go in, the pick comes out.
func (p *pipeline) sampleLocal(ctx context.Context, pos int, tokens []int32, smp *sched.SampleStep) ([]wire.TokenReply, *apiError) {
	s := p.s
	t0 := time.Now()
	w := sched.Work{Session: p.sess.kv, Pos: pos, Stage: &sched.Stage{First: 0, Last: p.headEnd, DType: p.dtype}, Tokens: tokens, Sample: smp}
	res, err := s.submit(ctx, w)
	s.metrics.computeDone(time.Since(t0))
	if err != nil {
		p.sess.ends.lost(pos)
		return nil, backendError(err)
	}
	p.sess.recordTokens(pos, tokens)
	p.sess.ends.sampled(pos, len(tokens), true)
	p.sess.touch(time.Now())
	return []wire.TokenReply{backendReply(res.Choice, p.params)}, nil
}

// hopCall is the hop of a pass the head ran.
func (p *pipeline) hopCall(pos int, tokens []int32, step int, verify bool) hopCall {
	tree := p.spec.treeState()
	call := hopCall{session: p.id, nTokens: len(tokens), hidden: p.s.cfg.Hidden, dtype: p.dtype, pos: pos, step: step,
		params: p.params, sess: p.sess, ticket: p.ticket, verify: verify, parents: tree.parents(), keep: tree.keepFor(pos)}
	if p.params.NeedsHistory() || verify {
		call.tokens = tokens
	}
	return call
}

// sendPass sends the activations of a pass the head ran (hb, which it
// puts back once no send reads it) down the route and checks the answer.
func (p *pipeline) sendPass(ctx context.Context, call hopCall, hb *hostBuf) ([]wire.TokenReply, *apiError) {
	s := p.s
	n, tokens, verify := call.nTokens, call.tokens, call.verify
	t1 := time.Now()
	var res *hopAnswer
	var ae *apiError
	if p.direct != nil {
		res, ae = p.sendDirect(ctx, call, hb) // its chain send puts hb back
	} else {
		res, ae = p.sendWaiting(ctx, call, hb.Bytes)
		s.hosts.put(hb)
	}
	if ae != nil {
		if ae.Type == "non_finite_activations" || ae.Type == "activations_out_of_range" {
			ae.Status = http.StatusBadGateway // the sender it names failed, not the request
		}
		return nil, ae
	}
	s.metrics.hopSent(time.Since(t1))
	defer res.done()
	toks := res.tokens
	if res.token != nil {
		toks = []wire.TokenReply{*res.token}
	}
	bad := func(format string, args ...any) *apiError {
		return &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: p.route[0].Name(), Message: fmt.Sprintf(format, args...)}
	}
	switch {
	case toks == nil:
		return nil, &apiError{Status: http.StatusBadGateway, Type: "route_incomplete", Hop: p.route[0].Name(),
			Message: fmt.Sprintf("the route ended at layer %d without reaching the model's last layer", res.endLayer)}
	case !verify && res.token == nil:
		return nil, bad("a verify answer to a one-token hop")
	case len(toks) > n:
		return nil, bad("%d tokens for a verify hop of %d rows", len(toks), n)
	}
	if call.parents != nil {
		if err := checkTreeAnswer(p.spec.treeState().pass, toks); err != nil {
			return nil, bad("%v", err)
		}
		return toks, nil
	}
	for i, t := range toks { // each checked by sendHop (wire.TokenReply.Check)
		// Accepted drafts are what this head fed: a tail that claims
		// other tokens would leave every cache on the route holding
		// tokens the text does not have.
		if i < len(toks)-1 && t.Token != tokens[i+1] {
			return nil, bad("the verify answer accepts token %d at row %d, but the draft there is %d", t.Token, i+1, tokens[i+1])
		}
	}
	return toks, nil
}

// planRoute picks the route of one request: X-Meshnet-Route from the
// tracker, else the configured route, else one built from the peers. The
// head runs 0..headEnd (X-Meshnet-End-Layer may shorten its range); the
// route must then cover headEnd+1..L-1 exactly.
func (s *Server) planRoute(ctx context.Context, h http.Header) (headEnd int, route []wire.Hop, ae *apiError) {
	L := s.cfg.NumLayers
	headEnd = s.cfg.Last
	if v := h.Get(wire.HeaderEndLayer); v != "" {
		e, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || e < 0 || e > s.cfg.Last {
			return 0, nil, headerError(wire.HeaderEndLayer, "want a layer in 0-%d, got %q", s.cfg.Last, wire.Truncate(v, 20))
		}
		headEnd = e
	}
	if v := h.Get(wire.HeaderRoute); v != "" {
		r, err := wire.ParseRoute(v, L)
		if err != nil {
			return 0, nil, headerError(wire.HeaderRoute, "%v", err)
		}
		route = r
	} else if len(s.Route) > 0 {
		route = s.Route
	} else if len(s.Peers) > 0 && headEnd < L-1 {
		r, err := s.peerRoute(ctx, headEnd)
		if err != nil {
			return 0, nil, &apiError{Status: http.StatusServiceUnavailable, Type: "no_route", Message: err.Error()}
		}
		route = r
	}
	if err := checkCoverage(headEnd, route, L); err != nil {
		return 0, nil, &apiError{Status: http.StatusServiceUnavailable, Type: "no_route",
			Message: err.Error() + " (start the head with --peer or --route, or send X-Meshnet-Route)"}
	}
	return headEnd, route, nil
}

// checkCoverage: the route runs headEnd+1..L-1, each layer once.
func checkCoverage(headEnd int, route []wire.Hop, L int) error {
	next := headEnd + 1
	for i, h := range route {
		if h.StartLayer != next {
			return fmt.Errorf("route hop %d (%s) starts at layer %d, want %d", i, h.Name(), h.StartLayer, next)
		}
		next = h.EndLayer + 1
	}
	if next != L {
		return fmt.Errorf("the head runs layers 0-%d and the route ends at layer %d; the model has %d layers", headEnd, next-1, L)
	}
	return nil
}

// peerRoute builds (and caches) a chain from the --peer nodes.
func (s *Server) peerRoute(ctx context.Context, headEnd int) ([]wire.Hop, error) {
	s.routeMu.Lock()
	defer s.routeMu.Unlock()
	if len(s.cachedRoute) > 0 && s.cachedRoute[0].StartLayer == headEnd+1 {
		return s.cachedRoute, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var peers []peerInfo
	for _, u := range s.Peers {
		h, err := s.fetchHealth(ctx, u)
		if err != nil {
			return nil, fmt.Errorf("peer %s: %v", u, err)
		}
		peers = append(peers, peerInfo{endpoint: strings.TrimRight(u, "/"), h: h})
	}
	r, err := chainRoute(headEnd, s.cfg.NumLayers, peers)
	if err != nil {
		return nil, err
	}
	s.cachedRoute = r
	rj, _ := json.Marshal(r)
	s.Logger.Info("built route from peers", "route", string(rj))
	return r, nil
}

// forgetPeerRoute drops the cached peer route after a hop failure, so the
// next request asks the peers again.
func (s *Server) forgetPeerRoute() {
	s.routeMu.Lock()
	s.cachedRoute = nil
	s.routeMu.Unlock()
}

type peerInfo struct {
	endpoint string
	h        Health
}

func (s *Server) fetchHealth(ctx context.Context, base string) (Health, error) {
	var h Health
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/health", nil)
	if err != nil {
		return h, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return h, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return h, err
	}
	if resp.StatusCode != http.StatusOK {
		return h, fmt.Errorf("GET /health answered %d", resp.StatusCode)
	}
	if err := json.Unmarshal(b, &h); err != nil {
		return h, fmt.Errorf("GET /health: %v", err)
	}
	if h.NumLayers != s.cfg.NumLayers || h.Hidden != s.cfg.Hidden {
		return h, fmt.Errorf("serves a model with %d layers and hidden %d; this head's has %d and %d", h.NumLayers, h.Hidden, s.cfg.NumLayers, s.cfg.Hidden)
	}
	return h, nil
}

// chainRoute covers layers headEnd+1..numLayers-1 with the fewest hops:
// at each step it enters, at the next layer needed, the peer that holds it
// and reaches furthest. Overlapping shards get a start layer inside their
// range, so no layer runs twice.
func chainRoute(headEnd, numLayers int, peers []peerInfo) ([]wire.Hop, error) {
	var route []wire.Hop
	for next := headEnd + 1; next < numLayers; {
		best := -1
		for i, p := range peers {
			if p.h.Layers[0] <= next && next <= p.h.Layers[1] && (best < 0 || p.h.Layers[1] > peers[best].h.Layers[1]) {
				best = i
			}
		}
		if best < 0 {
			return nil, fmt.Errorf("no peer holds layer %d (peers: %s)", next, describePeers(peers))
		}
		p := peers[best]
		route = append(route, wire.Hop{Endpoint: p.endpoint, StartLayer: next, EndLayer: p.h.Layers[1], PeerID: p.h.PeerID})
		next = p.h.Layers[1] + 1
	}
	return route, nil
}

func describePeers(peers []peerInfo) string {
	var b strings.Builder
	for i, p := range peers {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %d-%d", p.endpoint, p.h.Layers[0], p.h.Layers[1])
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}
