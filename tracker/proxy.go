package tracker

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/bodydeadline"
	"meshgpu/openai"
	"meshgpu/ticket"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// The chat proxy. Upstream requests always stream, so a generation that
// fails mid-way can resume on a new route: the head is asked to continue
// after the token ids streamed so far ("meshgpu":{"continue_ids":[...]},
// see docs/tracker.md and the Proxy section of the wire protocol), with
// max_tokens reduced by their count. The client sees one stream.

// generation is one choice of a proxied client request: a request with n
// choices or several prompts runs as one generation per (prompt, choice),
// each an upstream request of one prompt and n=1, so each resumes on its
// own (the head generates choice k of n with seed openai.ChoiceSeed(seed, k),
// and so does the tracker's k-th request: the choices are the same).
type generation struct {
	s      *Server
	out    *proxyOut
	ctx    context.Context
	path   string
	chat   bool
	stream bool // the client asked for a stream
	model  string
	req    map[string]any
	maxKey string
	max    int // -1: the client gave no limit
	index  int // the choice's index in the answer

	ids        []int        // token ids forwarded so far
	toks       []auditToken // the same with their logprobs, for audits
	logprobsOn bool         // the client asked for logprobs (the tracker always does upstream)
	topN       int          // the alternatives per token the client asked for
	// The current attempt's times: the tracker's measure of the route's
	// speed (Registry.observe), not the nodes' word. From the request's
	// sending, not the first token: a head that holds its tokens and
	// sends them in one burst gains nothing.
	sent, lastTok time.Time
	attemptToks   int
	shadow        *shadow // the disputed range's other replica, compared token by token
	// auditVersion is the audit failure count seen when the attempt's
	// route was chosen (auditor.failedHop).
	auditVersion uint64
	untracked    bool // text was forwarded without its token id: replay impossible
	// tail is the text forwarded after the last id (an honest head sends
	// id-less text only at the end: text held back for a stop string);
	// end is the head's end-of-text step (meshgpu_end). Both are audited.
	tail      strings.Builder
	end       *auditToken
	text      strings.Builder
	finish    any // finish_reason of the final chunk
	usage     *openai.Usage
	logprobs  []*openai.ChunkLogprobs // each chunk's choice logprobs, for a non-streamed answer
	toolCalls []openai.ToolCall       // the head's tool_calls deltas, for a non-streamed answer
	attempt   int
	// The current attempt's route ticket (as sent) and its session id,
	// the session on every hop after the head; "" when the head runs
	// every layer.
	ticket, ticketSession string
	// claims is this generation's backoff of the nodes its heads named
	// busy; answered holds the heads that named another hop (avoidUntil).
	claims     *busyBackoff
	answered   map[string]bool
	busyWaited time.Duration // time spent waiting them out, bounded by Config.BusyWait
	// pathDown holds nodes the head could not reach through their relay,
	// with the error: routed around for the rest of the generation, never
	// banned (the node is fine; its relay connection is not).
	pathDown   map[string]string
	draining   map[string]bool // of pathDown: the node said shutting_down
	startIDs   int             // len(ids) when the current attempt began
	roleSent   bool            // the assistant role went to the client
	finishSent bool            // a chunk with finish_reason went to the client
}

// proxyOut is the client's side of a proxied request, shared by its
// generations (which run one after another).
type proxyOut struct {
	w       http.ResponseWriter
	sse     openai.SSEWriter
	id      string
	created int64
	model   string
	chat    bool
	stream  bool
	// variant is the fingerprint of the weights serving the request, set
	// by the first chunk a head sends: from then on every route of the
	// request (failovers, further choices) is of this variant, so a
	// client's answer never mixes two variants' tokens.
	variant *string
}

// pin fixes the request's variant to rt's, once, and names it in the
// response headers (before any byte goes out: the first chunk is what
// pins it).
func (o *proxyOut) pin(rt route.Route) {
	if o.variant != nil {
		return
	}
	fp := rt.Variant.Fingerprint
	o.variant = &fp
	if !rt.Variant.IsZero() && !o.sse.Started() {
		o.w.Header().Set(wire.HeaderVariant, rt.Variant.Fingerprint)
		o.w.Header().Set(wire.HeaderVariantLabel, rt.Variant.Label)
	}
}

// attemptResult says how one route attempt ended.
type attemptResult struct {
	done      bool
	clientErr *wire.Error // a 4xx from the head about the request itself
	failHop   string      // the peer to ban
	failMsg   string
	// busyHop answered back-pressure (429, 503 busy): not a failure, it is
	// avoided (or waited for) for retryAfter and the attempt is not counted.
	busyHop    string
	retryAfter time.Duration
	// pathDown is a node whose relay path failed (wire.TypeRelayUnreachable):
	// routed around without a ban, the failure counted as an attempt.
	pathDown string
	// draining: pathDown answered 503 shutting_down (it is leaving the
	// mesh, SIGTERM): routed around without a ban like a path outage.
	draining bool
	// renew: a hop refused the attempt's route ticket as expired, and it
	// has (by this tracker's clock): the generation resumes on a new
	// ticket, no ban, not counted as an attempt.
	renew bool
	// route is the attempt's route, session its ticket's session id (the
	// session on every hop after the head) and ticket the ticket itself:
	// on a failure the tracker frees the session downstream under a
	// release it signs for the ticket (node/tickets.go, authorizeDelete).
	route    route.Route
	session  string
	ticket   string
	writeErr error // the client went away
}

func (s *Server) proxy(path string) http.HandlerFunc {
	chat := path == "/v1/chat/completions"
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
		if err != nil {
			s.writeError(w, errf(bodydeadline.Status(err), "invalid_request_error", "request body larger than %d bytes, too slow or unreadable: %v", s.cfg.MaxBodyBytes, err))
			return
		}
		// The same validation as the head's, so both answer a bad request
		// alike; the head then checks what needs the model.
		parsed, we := openai.ParseRequest(body, chat)
		if we != nil {
			s.writeError(w, we)
			return
		}
		// Clients may choose the head's speculation (meshgpu.speculate);
		// continue_ids is the tracker's.
		if m := parsed.Meshgpu; m != nil {
			if m.ContinueIDs != nil {
				s.writeError(w, wire.Invalid("meshgpu.continue_ids", "meshgpu.continue_ids is reserved for the tracker; clients may set only meshgpu.speculate"))
				return
			}
			if _, err := wire.ParseSpeculateMode(m.Speculate); err != nil {
				s.writeError(w, wire.Invalid("meshgpu.speculate", "%v", err))
				return
			}
		}
		// The fields go upstream as the client wrote them (a schema's
		// property order is the order its documents are written in).
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
			s.writeError(w, errf(400, "invalid_request_error", "request body must be a JSON object"))
			return
		}
		req := make(map[string]any, len(fields))
		for k, v := range fields {
			req[k] = v
		}
		model, err := s.servedModel(r.Context(), parsed.Model)
		if err != nil {
			s.writeError(w, err)
			return
		}
		out := &proxyOut{w: w, sse: openai.SSEWriter{W: w}, id: openai.NewID(openai.IDPrefix(chat)), created: s.cfg.Clock().Unix(),
			model: model, chat: chat, stream: parsed.Stream}
		defer out.sse.End()
		gens := s.splitChoices(out, path, parsed, req, r.Context())
		var usage openai.Usage
		choices := make([]openai.Choice, 0, len(gens))
		for i, g := range gens {
			if ae := g.run(); ae != nil {
				s.proxied.WithLabelValues(outcomeOf(ae)).Inc()
				if ae.Status == 499 {
					return
				}
				if out.sse.Started() {
					out.sse.Event(wire.ErrorBody{Error: ae})
				} else {
					s.writeError(w, ae)
				}
				return
			}
			s.proxied.WithLabelValues("ok").Inc()
			// Usage: each prompt once (its first choice), every completion.
			pt, ct := g.usageCounts()
			if i%parsed.NChoices == 0 {
				usage.PromptTokens += pt
			}
			usage.CompletionTokens += ct
			choices = append(choices, g.choice())
		}
		usage.TotalTokens = usage.PromptTokens + usage.CompletionTokens
		if out.stream {
			if parsed.IncludeUsage {
				out.sse.Event(openai.Completion{ID: out.id, Object: openai.Object(chat, true), Created: out.created, Model: model,
					Choices: []openai.Choice{}, Usage: &usage})
			}
			out.sse.Done()
			return
		}
		writeJSON(w, 200, openai.Completion{ID: out.id, Object: openai.Object(chat, false), Created: out.created, Model: model,
			Choices: choices, Usage: &usage})
	}
}

func outcomeOf(ae *wire.Error) string {
	switch {
	case ae.Status == 499:
		return "client_gone"
	case ae.Status >= 400 && ae.Status < 500:
		return "client_error"
	}
	return "failed"
}

// splitChoices makes one generation per (prompt, choice) of the request.
func (s *Server) splitChoices(out *proxyOut, path string, parsed *openai.Request, req map[string]any, ctx context.Context) []*generation {
	prompts := []any{nil}
	if !parsed.Chat && len(parsed.Prompts) > 1 {
		var list []json.RawMessage
		json.Unmarshal(req["prompt"].(json.RawMessage), &list) // ParseRequest read it as a list
		prompts = prompts[:0]
		for _, p := range list {
			prompts = append(prompts, p)
		}
	}
	// Every generation has a seed, the tracker's when the client sent none,
	// so an audit's referee reproduces its draws (the client's answer does
	// not name it, so it does not change).
	seed := parsed.Seed
	if seed == nil {
		own := rand.Int64()
		seed = &own
	}
	var gens []*generation
	for pi, prompt := range prompts {
		for k := 0; k < parsed.NChoices; k++ {
			sub := make(map[string]any, len(req)+2)
			for key, v := range req {
				sub[key] = v
			}
			delete(sub, "n")
			delete(sub, "best_of")
			if prompt != nil {
				sub["prompt"] = prompt
			}
			if k > 0 || parsed.Seed == nil {
				sub["seed"] = int64(openai.ChoiceSeed(uint64(*seed), k))
			}
			g := &generation{s: s, out: out, ctx: ctx, path: path, chat: parsed.Chat, stream: parsed.Stream, model: out.model,
				req: sub, max: -1, maxKey: "max_tokens", index: pi*parsed.NChoices + k}
			if parsed.Chat && parsed.MaxCompletionTokens != nil {
				g.maxKey = "max_completion_tokens"
			}
			if parsed.MaxTokensSet > 0 {
				g.max = parsed.MaxTokensSet
			}
			g.logprobsOn, g.topN = parsed.LogprobsOn, parsed.TopLogprobsN
			gens = append(gens, g)
		}
	}
	return gens
}

// run generates the choice, failing over to new routes; nil when it
// finished (its chunks streamed, or its text kept for the answer).
func (g *generation) run() *wire.Error {
	seed := g.s.seq.Add(1) * 0x9e3779b97f4a7c15
	var lastErr error
	for g.attempt = 0; g.attempt < g.s.cfg.MaxAttempts; g.attempt++ {
		if g.ctx.Err() != nil {
			return &wire.Error{Status: 499, Type: "canceled", Message: "client went away"}
		}
		if g.max >= 0 && len(g.ids) >= g.max {
			// Every token came before the failure; only the final chunk
			// is missing.
			g.finish, lastErr = "length", nil
			break
		}
		_, g.auditVersion = g.s.audit.failedHop(route.Route{}, 0) // failures from now on move the attempt
		res, err := g.tryRoute(seed + uint64(g.attempt))
		if err != nil {
			lastErr = err
			break
		}
		switch {
		case res.writeErr != nil || g.ctx.Err() != nil:
			return &wire.Error{Status: 499, Type: "canceled", Message: "client went away"}
		case res.done:
			g.s.backoff.progress(routePeers(res.route)...)
			g.s.audit.offer(g, res.route)
			return g.finishChoice()
		case res.clientErr != nil:
			return res.clientErr
		case res.renew:
			g.freeSessions(res)
			g.s.log.Info("tracker proxy: route ticket expired during the generation, resuming on a new one (no ban)",
				"session", res.session, "tokens_so_far", len(g.ids))
			g.attempt--
			continue
		case res.pathDown != "":
			if g.pathDown == nil {
				g.pathDown = map[string]string{}
			}
			g.pathDown[res.pathDown] = res.failMsg
			g.freeSessions(res)
			if res.draining {
				if g.draining == nil {
					g.draining = map[string]bool{}
				}
				g.draining[res.pathDown] = true
				g.s.log.Info("tracker proxy: node is shutting down, routing around it (no ban)",
					"peer", res.pathDown, "reason", res.failMsg, "tokens_so_far", len(g.ids), "attempt", g.attempt+1)
				lastErr = errf(503, typeShuttingDown, "%s", res.failMsg)
				continue
			}
			g.s.log.Warn("tracker proxy: relay path failed, routing around the node (no ban)",
				"peer", res.pathDown, "reason", res.failMsg, "tokens_so_far", len(g.ids), "attempt", g.attempt+1)
			lastErr = errf(503, wire.TypeRelayUnavailable, "%s", res.failMsg)
			continue
		}
		// The ban is shared with the other trackers even when the client
		// has gone meanwhile.
		bctx, bcancel := context.WithTimeout(context.WithoutCancel(g.ctx), 5*time.Second)
		if err := g.s.reg.Ban(bctx, res.failHop, g.s.cfg.BanDuration); err != nil {
			g.s.log.Error("tracker proxy: recording a ban failed", "peer", res.failHop, "err", err)
		}
		bcancel()
		g.freeSessions(res)
		g.s.log.Warn("tracker proxy: route failed, banning node and replaying",
			"peer", res.failHop, "reason", res.failMsg, "tokens_so_far", len(g.ids), "attempt", g.attempt+1, "variant", res.route.Variant)
		lastErr = errf(502, "upstream_error", "node %s failed: %s", res.failHop, res.failMsg)
		if g.untracked {
			lastErr = errf(502, "upstream_error", "node %s failed and the head sent text without token ids, so the generation cannot resume: %s", res.failHop, res.failMsg)
			break
		}
		if g.attempt+1 < g.s.cfg.MaxAttempts {
			g.s.failovers.Inc()
		}
	}
	if g.finish != nil && lastErr == nil {
		return g.finishChoice()
	}
	if lastErr == nil {
		lastErr = errf(502, "upstream_error", "generation did not finish")
	}
	var ae *apiError
	if !errors.As(lastErr, &ae) {
		ae = errf(500, "server_error", "%v", lastErr)
	}
	return ae
}

// Back-pressure waits: a busy answer without Retry-After is retried after
// defaultBusyRetry; a Retry-After longer than maxBusyRetry is cut to it, as
// a slot on a node frees at the pace of tokens, not of the header's seconds.
const (
	defaultBusyRetry = 200 * time.Millisecond
	maxBusyRetry     = 2 * time.Second
)

// tryRoute routes and runs one attempt, waiting out back-pressure, which
// is not an attempt: a node that answered busy is avoided for its
// Retry-After while another replica covers its layers, and waited for when
// none does, within Config.BusyWait in all; then the client gets the 429.
func (g *generation) tryRoute(seed uint64) (attemptResult, error) {
	for tries := uint64(0); ; tries++ {
		avoid := func(id string) bool {
			return g.pathDown[id] != "" || time.Now().Before(g.avoidUntil(id))
		}
		rt, err := g.s.route(g.ctx, g.model, g.out.variant, seed+tries*0x632be59bd9b4e019, avoid)
		if errors.Is(err, ErrAvoided) {
			for _, h := range rt.Hops {
				if msg := g.pathDown[h.PeerID]; msg != "" && g.draining[h.PeerID] {
					return attemptResult{}, errf(503, typeShuttingDown, "%s; no other node covers its layers", msg)
				} else if msg != "" {
					// Waiting helps a busy node, not a cut-off one: say so now.
					return attemptResult{}, errf(503, wire.TypeRelayUnavailable, "%s; no other node covers its layers (it is routed again once its relay connection is back)", msg)
				}
			}
			var until time.Time
			for _, h := range rt.Hops {
				if u := g.avoidUntil(h.PeerID); u.After(until) {
					until = u
				}
			}
			if err := g.waitBusy(time.Until(until)); err != nil {
				return attemptResult{}, err
			}
		} else if err != nil {
			return attemptResult{}, err
		}
		release := g.s.reg.Acquire(rt)
		res := g.try(rt)
		release()
		if res.done && g.attemptToks > 0 {
			g.s.reg.observe(rt, g.attemptToks, g.lastTok.Sub(g.sent))
		}
		res.route, res.session, res.ticket = rt, g.ticketSession, g.ticket
		if res.busyHop == "" || g.untracked {
			if res.busyHop != "" { // text without ids cannot resume: a failure after all
				res.failHop, res.busyHop = res.busyHop, ""
			}
			return res, nil
		}
		g.s.busy.Inc()
		// Shared by every generation, and charged to the head the tracker
		// gave the ticket: a node busy without progress is avoided longer
		// at each busy answer (busy.go). Which hop was busy is the head's
		// word (its error body), so it binds this generation only: else a
		// head naming an honest tail would keep every generation off it.
		now, head := time.Now(), rt.Hops[0].PeerID
		g.s.backoff.busy(head, res.retryAfter, now)
		if g.claims == nil {
			g.claims, g.answered = newBusyBackoff(g.s.cfg.BusyBackoffMax), map[string]bool{}
		}
		wait := time.Until(g.claims.busy(res.busyHop, res.retryAfter, now))
		if res.busyHop != head {
			g.answered[head] = true
		}
		g.s.log.Info("tracker proxy: node busy, routing around it or waiting (no ban)",
			"peer", res.busyHop, "head", head, "reason", res.failMsg, "retry_after", wait, "tokens_so_far", len(g.ids))
		if g.busyWaited >= g.s.cfg.BusyWait {
			return attemptResult{}, &apiError{Status: http.StatusTooManyRequests, Type: wire.TypeQueueFull, RetryAfter: 1,
				Message: fmt.Sprintf("the mesh is busy: waited %v for a free node (%s); retry later", g.busyWaited.Round(time.Millisecond), res.failMsg)}
		}
	}
}

// avoidUntil is until when this generation avoids peer: the nodes its
// heads named busy (g.claims), and the heads every generation avoids for
// answering busy (g.s.backoff), except a head that named another hop to
// this generation: it took the request, so it is tried again here at once.
func (g *generation) avoidUntil(peer string) time.Time {
	var u time.Time
	if g.claims != nil {
		u = g.claims.until(peer)
	}
	if s := g.s.backoff.until(peer); !g.answered[peer] && s.After(u) {
		u = s
	}
	return u
}

// waitBusy sleeps d (at least a millisecond) for a busy node, counting it
// against Config.BusyWait.
func (g *generation) waitBusy(d time.Duration) error {
	d = max(d, time.Millisecond)
	if g.busyWaited+d > g.s.cfg.BusyWait {
		return &apiError{Status: http.StatusTooManyRequests, Type: wire.TypeQueueFull, RetryAfter: 1,
			Message: fmt.Sprintf("every node that can serve %s is busy after %v of waiting; retry later", g.model, g.busyWaited.Round(time.Millisecond))}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		g.busyWaited += d
		return nil
	case <-g.ctx.Done():
		return &wire.Error{Status: 499, Type: "canceled", Message: "client went away"}
	}
}

// retryAfter reads a Retry-After header in seconds (0 when absent).
func retryAfter(h http.Header) time.Duration {
	n, err := strconv.Atoi(strings.TrimSpace(h.Get("Retry-After")))
	if err != nil || n < 0 {
		return 0
	}
	return time.Duration(n) * time.Second
}

// try runs one route attempt.
func (g *generation) try(rt route.Route) attemptResult {
	head := rt.Hops[0]
	g.startIDs = len(g.ids)
	g.ticket, g.ticketSession = "", ""
	g.attemptToks = 0
	g.end = nil
	up := upstreamRequest(g.req, g.chat, g.model, g.ids, g.max, g.maxKey, g.s.audit.on())
	body, err := json.Marshal(up)
	if err != nil {
		return attemptResult{clientErr: errf(400, "invalid_request_error", "request cannot be re-encoded")}
	}
	ctx, cancel := context.WithCancel(g.ctx)
	defer cancel()
	var timedOut atomic.Bool
	timer := time.AfterFunc(g.s.cfg.FirstByte, func() { timedOut.Store(true); cancel() })
	defer timer.Stop()

	g.sent = time.Now()
	resp, session, tk, err := g.s.postToHead(ctx, rt, g.path, body)
	g.ticketSession, g.ticket = session, tk
	if err != nil {
		if timedOut.Load() {
			err = fmt.Errorf("no response within %v", g.s.cfg.FirstByte)
		} else if path := (interface{ RelayPath() string })(nil); head.Endpoint == "" && g.ctx.Err() == nil && errors.As(err, &path) {
			// Only the relay client's path error (relay.PathError: the relay
			// is down or the head is not connected to it) is the relay's
			// fault; a reset, EOF or crash of the head is the head's own,
			// as on the head's side (node/hopclient.go).
			return attemptResult{pathDown: head.PeerID, failMsg: fmt.Sprintf("head %s through relay %s: %v", head.PeerID, relayBase(head.RelayAddr), err)}
		}
		return attemptResult{failHop: head.PeerID, failMsg: err.Error()}
	}
	defer resp.Body.Close()
	timer.Reset(g.s.cfg.TokenTimeout)

	if resp.StatusCode == http.StatusOK {
		// A disputed range runs on both replicas (tracker/dispute.go).
		var ae *wire.Error
		if g.shadow, ae = g.s.audit.startShadow(ctx, rt, g.path, body); ae != nil {
			return attemptResult{clientErr: ae}
		} else if g.shadow != nil {
			defer g.shadow.stop()
		}
	}
	if resp.StatusCode != http.StatusOK {
		refusal := readRefusal(resp)
		hop, typ, msg := refusal.named()
		if wire.Backpressure(resp.StatusCode, typ) {
			return attemptResult{busyHop: g.hopPeer(rt, hop), retryAfter: retryAfter(resp.Header), failMsg: fmt.Sprintf("HTTP %d %s: %s", resp.StatusCode, typ, msg)}
		}
		if peer, ok := relayBlame(rt, typ, hop); ok {
			return attemptResult{pathDown: peer, failMsg: msg}
		}
		if typ == wire.TypeTicketExpired && g.ticketExpired() {
			return attemptResult{renew: true, failMsg: msg}
		}
		if resp.StatusCode == http.StatusServiceUnavailable && typ == typeShuttingDown {
			// A draining node (SIGTERM) refuses new work until it stops:
			// go elsewhere, it has not failed.
			return attemptResult{pathDown: g.hopPeer(rt, hop), draining: true, failMsg: fmt.Sprintf("HTTP 503 %s: %s", typ, msg)}
		}
		// Only an answer about the request itself goes back to the client,
		// with the same status and error as from the head; any other (404:
		// not a head, 401/403: a head with its own keys, 5xx) is the head's
		// failure: route around it.
		if resp.StatusCode == 400 || resp.StatusCode == 413 || resp.StatusCode == 422 {
			we := refusal.err
			if we == nil {
				we = &wire.Error{Status: resp.StatusCode, Type: wire.TypeInvalidRequest, Message: msg}
			}
			we.Hop = ""
			return attemptResult{clientErr: we}
		}
		return attemptResult{failHop: g.hopPeer(rt, hop), failMsg: fmt.Sprintf("HTTP %d: %s", resp.StatusCode, msg)}
	}

	chunks := openai.NewChunkReader(resp.Body, maxHeadEvent)
	var readErr error
	for {
		chunk, err := chunks.Next()
		if errors.Is(err, openai.ErrBadChunk) {
			return attemptResult{failHop: head.PeerID, failMsg: "head sent an event that is not a JSON object"}
		}
		if err != nil {
			if err != io.EOF {
				readErr = err
			}
			break
		}
		timer.Reset(g.s.cfg.TokenTimeout)
		if res, stop := g.event(rt, chunk); stop {
			return res
		}
		// A node of the route failed an audit meanwhile: the rest of the
		// generation runs on another replica (the replay failover).
		var bad string
		if bad, g.auditVersion = g.s.audit.failedHop(rt, g.auditVersion); bad != "" {
			return attemptResult{failHop: bad, failMsg: "failed an audit"}
		}
	}
	if chunks.Done() {
		return g.done()
	}
	// The stream ended without [DONE]: finished if the final chunk came.
	if g.finish != nil && !timedOut.Load() {
		return g.done()
	}
	msg := "stream ended before the generation finished"
	if timedOut.Load() {
		msg = fmt.Sprintf("no stream event within %v", g.s.cfg.TokenTimeout)
	} else if readErr != nil {
		msg = "stream broke: " + readErr.Error()
	}
	return attemptResult{failHop: head.PeerID, failMsg: msg}
}

// done ends an attempt whose stream ended; under dispute only when the
// copy ended there too (a head cannot cut a disputed answer short).
func (g *generation) done() attemptResult {
	if g.shadow != nil {
		if ae := g.shadow.ended(len(g.ids)); ae != nil {
			return attemptResult{clientErr: ae}
		}
	}
	return attemptResult{done: true}
}

// ticketExpired reports whether the current attempt's route ticket has
// expired by this tracker's clock: only then is a hop's ticket_expired an
// excuse (a node's clock within the skew refuses no earlier); otherwise it
// is the named hop's failure.
func (g *generation) ticketExpired() bool {
	raw, err := ticket.FromString(g.ticket)
	if err != nil {
		return false
	}
	t, err := ticket.Parse(raw)
	return err == nil && !g.s.cfg.Clock().Before(t.Expiry)
}

// routePeers are the peer ids of rt's hops.
func routePeers(rt route.Route) []string {
	ids := make([]string, len(rt.Hops))
	for i, h := range rt.Hops {
		ids[i] = h.PeerID
	}
	return ids
}

// upstreamRequest is the request a head gets for a generation that has
// streamed ids so far (a failover replay continues after them, with the
// limit reduced by their count). Proxied generations and audits' referee
// sessions are built here alike, so a node cannot tell them apart: with
// audits on, every one asks for logprobs with auditTopLogprobs
// alternatives (a client's answer keeps only what it asked for).
func upstreamRequest(req map[string]any, chat bool, model string, ids []int, max int, maxKey string, audits bool) map[string]any {
	up := make(map[string]any, len(req)+4)
	for k, v := range req {
		up[k] = v
	}
	up["stream"] = true
	// usage comes in its own chunk, summed over choices for the client
	up["stream_options"] = map[string]any{"include_usage": true}
	up["model"] = model
	if audits && !echoed(req) {
		markLogprobs(up, chat, auditTopLogprobs)
	}
	if len(ids) > 0 {
		ext := map[string]any{"continue_ids": ids}
		if raw, ok := req["meshgpu"].(json.RawMessage); ok {
			var m map[string]json.RawMessage
			json.Unmarshal(raw, &m) // validated on arrival
			for k, v := range m {   // the client's meshgpu.speculate, as written
				if k != "continue_ids" {
					ext[k] = v
				}
			}
		}
		up["meshgpu"] = ext
		if max >= 0 {
			up[maxKey] = max - len(ids)
		}
	}
	return up
}

// echoed says whether a completions request asks for its prompt back
// (echo true), which takes no logprobs alternatives.
func echoed(req map[string]any) bool {
	switch e := req["echo"].(type) {
	case json.RawMessage:
		var b bool
		return json.Unmarshal(e, &b) == nil && b
	case bool:
		return e
	}
	return false
}

// event handles one chunk of the head's stream; stop ends the attempt.
func (g *generation) event(rt route.Route, chunk *openai.Chunk) (attemptResult, bool) {
	if e := chunk.Error; e != nil {
		hop, typ, msg := eventError(e)
		if wire.Backpressure(0, typ) {
			return attemptResult{busyHop: g.hopPeer(rt, hop), failMsg: typ + ": " + msg}, true
		}
		if peer, ok := relayBlame(rt, typ, hop); ok {
			return attemptResult{pathDown: peer, failMsg: msg}, true
		}
		if typ == wire.TypeTicketExpired && g.ticketExpired() {
			return attemptResult{renew: true, failMsg: msg}, true
		}
		return attemptResult{failHop: g.hopPeer(rt, hop), failMsg: msg}, true
	}
	g.out.pin(rt)
	tok, hasTok := -1, chunk.Meshgpu != nil
	audited := auditToken{id: tok, logprob: math.NaN()}
	if hasTok {
		tok = int(chunk.Meshgpu.Token)
		audited.id, audited.top = tok, chunk.Meshgpu.Top
	}
	if e := endOf(chunk); e != nil {
		g.end = e
	}
	// The client's chunk: the head's with the request's id, time and
	// model, and of the head's extension field only the token id (OpenAI
	// clients ignore it, and a client can check ids across a failover).
	out := openai.Completion{ID: g.out.id, Object: chunk.Object, Created: g.out.created, Model: g.model,
		SystemFingerprint: chunk.SystemFingerprint, Choices: make([]openai.Choice, len(chunk.Choices))}
	if chunk.Choices == nil {
		out.Choices = nil
	}
	if hasTok {
		out.Meshgpu = &openai.ChunkMeshgpu{Token: int32(tok)}
	}
	for i, c := range chunk.Choices {
		out.Choices[i] = openai.Choice{Index: c.Index, Text: c.Text, Delta: c.Delta, FinishReason: c.FinishReason}
		if c.Logprobs != nil {
			out.Choices[i].Logprobs = c.Logprobs.Shape(g.chat)
		}
	}
	it, hasChoice := itemOf(chunk, g.chat)
	finished, droppedRole := false, false
	if hasChoice {
		c, oc := chunk.Choices[0], &out.Choices[0]
		oc.Index = g.index
		if lp := c.Logprobs; lp != nil {
			audited.text, audited.logprob = lp.Chosen(g.chat)
			if g.logprobsOn {
				lp.TrimTop(g.chat, g.topN) // the tracker asked for more (audits)
				g.logprobs = append(g.logprobs, lp)
			} else {
				oc.Logprobs = nil // asked for audits only
			}
		}
		if d := c.Delta; g.chat && d != nil {
			g.toolCalls = append(g.toolCalls, d.ToolCalls...)
			if d.Role != "" {
				if g.roleSent {
					od := *d
					od.Role = "" // a replay's head opens again
					oc.Delta, droppedRole = &od, true
				}
				g.roleSent = true
			}
		}
		finished = c.FinishReason != nil
	}
	if u := chunk.Usage; u != nil {
		g.fixUsage(u)
		g.usage = u // the client gets the sum over choices at the end
		if len(chunk.Choices) == 0 {
			return attemptResult{}, false // the usage-only chunk
		}
	}
	if hasTok && g.tail.Len() > 0 && g.s.audit.on() {
		// Text the head sent without its id escaped every check of ids:
		// with audits on it is a head failure, not text for the client.
		return attemptResult{failHop: rt.Hops[0].PeerID, failMsg: fmt.Sprintf("head sent text without its token id before token %d", len(g.ids))}, true
	}
	if g.shadow != nil && hasChoice {
		if ae := g.shadow.agree(len(g.ids), it); ae != nil {
			return attemptResult{clientErr: ae}, true
		}
	}
	content := it.content
	if hasTok {
		g.attemptToks++
		g.lastTok = time.Now()
		g.ids = append(g.ids, tok)
		audited.content = content
		g.toks = append(g.toks, audited)
	} else if content != "" || it.tools != "" {
		g.untracked = true
		g.tail.WriteString(content)
	}
	if finished {
		g.finish = it.finish
		g.finishSent = g.stream
	}
	if droppedRole && !hasTok && content == "" && !finished {
		return attemptResult{}, false // a replay's role-only opening chunk
	}
	g.text.WriteString(content)
	if g.stream {
		if err := g.writeEvent(out); err != nil {
			return attemptResult{writeErr: err}, true
		}
	}
	return attemptResult{}, false
}

// fixUsage restates a replay's usage for the original request: the head
// counts the original prompt as prompt_tokens and only its new tokens as
// completion_tokens (docs/protocol.md, "Proxy support"), so the continued
// ids are added to completion and total.
func (g *generation) fixUsage(u *openai.Usage) {
	u.CompletionTokens += g.startIDs
	u.TotalTokens += g.startIDs
}

func (g *generation) writeEvent(v any) error { return g.out.sse.Event(v) }

// freeSessionsTimeout bounds freeing a failed route's sessions, which
// delays the replay: a node that hangs costs at most this.
const freeSessionsTimeout = time.Second

// freeSessions deletes the failed attempt's session on every node after
// the head (DELETE /sessions/{id}, in parallel, with the tracker's signed
// release of the session's route ticket, which the nodes take instead of
// the session key the tracker never holds): a head that died cannot
// free them, and they would hold KV caches until their TTL. A head that
// is alive frees them too; a second DELETE is a harmless 404.
func (g *generation) freeSessions(res attemptResult) {
	if !wire.ValidSessionID(res.session) || res.ticket == "" || len(res.route.Hops) < 2 {
		return
	}
	raw, err := ticket.FromString(res.ticket)
	if err != nil {
		return
	}
	release := base64.RawURLEncoding.EncodeToString(ticket.SignRelease(g.s.cfg.TicketKey, res.session, raw))
	ctx, cancel := context.WithTimeout(context.WithoutCancel(g.ctx), freeSessionsTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, h := range res.route.Hops[1:] {
		if h.PeerID == res.pathDown && !res.draining {
			continue // its relay path just failed: a delete would only wait out the timeout
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var resp *http.Response
			var err error
			switch {
			case h.Endpoint != "":
				req, rerr := http.NewRequestWithContext(identity.WithPeerID(ctx, h.PeerID), http.MethodDelete, strings.TrimSuffix(h.Endpoint, "/")+"/sessions/"+res.session, nil)
				if rerr != nil {
					return
				}
				req.Header.Set(wire.HeaderSessionRelease, release)
				resp, err = g.s.cfg.HTTPClient.Do(req)
			case h.RelayAddr != "" && g.s.cfg.Relay != nil:
				req, rerr := http.NewRequestWithContext(ctx, http.MethodDelete, "http://relay.invalid/sessions/"+res.session, nil)
				if rerr != nil {
					return
				}
				req.Header.Set(wire.HeaderSessionRelease, release)
				resp, err = g.s.cfg.Relay.Do(ctx, h.RelayAddr, req)
			default:
				return
			}
			if err != nil {
				g.s.log.Debug("tracker proxy: freeing a failed route's session", "peer", h.PeerID, "session", res.session, "err", err)
				return
			}
			io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
			resp.Body.Close()
		}()
	}
	wg.Wait()
}

// finishChoice ends the choice's stream with a final chunk if the head's
// did not come.
func (g *generation) finishChoice() *wire.Error {
	if g.finish == nil {
		g.finish = "stop"
	}
	if g.stream && !g.finishSent {
		reason, _ := g.finish.(string)
		c := openai.Choice{Index: g.index, FinishReason: &reason}
		if g.chat {
			c.Delta = &openai.ChatMessage{}
		} else {
			empty := ""
			c.Text = &empty
		}
		if err := g.writeEvent(openai.Completion{ID: g.out.id, Object: openai.Object(g.chat, true), Created: g.out.created, Model: g.model,
			Choices: []openai.Choice{c}}); err != nil {
			return &wire.Error{Status: 499, Type: "canceled", Message: "client went away"}
		}
	}
	return nil
}

// usageCounts is the choice's prompt and completion tokens.
func (g *generation) usageCounts() (prompt, completion int) {
	if g.usage == nil {
		return 0, len(g.ids)
	}
	return g.usage.PromptTokens, g.usage.CompletionTokens
}

// choice is the finished choice of a non-streamed answer.
func (g *generation) choice() openai.Choice {
	reason, _ := g.finish.(string)
	text := g.text.String()
	c := openai.Choice{Index: g.index, FinishReason: &reason}
	if g.chat {
		c.Message = &openai.ChatMessage{Role: "assistant", Content: &text}
		if len(g.toolCalls) > 0 {
			calls := slices.Clone(g.toolCalls)
			for i := range calls {
				calls[i].Index = nil // only stream deltas carry it
			}
			c.Message.ToolCalls = calls
			if text == "" {
				c.Message.Content = nil
			}
		}
	} else {
		c.Text = &text
	}
	if len(g.logprobs) > 0 {
		c.Logprobs = mergeLogprobs(g.chat, g.logprobs)
	}
	return c
}

// mergeLogprobs joins the logprobs of a choice's chunks into one.
func mergeLogprobs(chat bool, parts []*openai.ChunkLogprobs) any {
	all := &openai.ChunkLogprobs{ // empty lists, not null, when the parts are
		ChatLogprobs: openai.ChatLogprobs{Content: []openai.TokenLogprob{}},
		CompletionLogprobs: openai.CompletionLogprobs{Tokens: []string{}, TokenLogprobs: []float64{},
			TopLogprobs: []map[string]float64{}, TextOffset: []int{}},
	}
	for _, p := range parts {
		all.Append(p)
	}
	return all.Shape(chat)
}

// typeShuttingDown is a draining node's 503 (daemon/drain.go).
const typeShuttingDown = "shutting_down"

// relayBlame reports the peer an error of type typ naming hop blames on
// its relay path, and whether the tracker believes it: only a
// relay_unreachable naming a relay-only hop of the route after the head
// (no endpoint, so its relay is the only way to it). A head or a node
// after it could otherwise label its own failures as relay outages (an
// unknown name, a direct peer, the head itself) and never be banned; those
// are failures of the hop hopPeer names.
func relayBlame(rt route.Route, typ, hop string) (string, bool) {
	if typ != wire.TypeRelayUnreachable || hop == "" {
		return "", false
	}
	for _, h := range rt.Hops[1:] {
		if h.Endpoint == "" && h.RelayAddr != "" && (hop == h.PeerID || hop == h.RelayAddr) {
			return h.PeerID, true
		}
	}
	return "", false
}

// hopPeer maps an error's hop name (endpoint, relay address or peer id)
// to the route's peer; unknown names blame the head.
func (g *generation) hopPeer(rt route.Route, name string) string {
	if name != "" {
		for _, h := range rt.Hops {
			if name == h.PeerID || name == h.Endpoint || (h.RelayAddr != "" && name == h.RelayAddr) ||
				strings.TrimSuffix(name, "/") == strings.TrimSuffix(h.Endpoint, "/") {
				return h.PeerID
			}
		}
	}
	return rt.Hops[0].PeerID
}
