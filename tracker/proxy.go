package tracker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// The chat proxy. Upstream requests always stream, so a generation that
// fails mid-way can resume on a new route: the head is asked to continue
// after the token ids streamed so far ("meshgpu":{"continue_ids":[...]},
// see docs/tracker.md and the Proxy section of the wire protocol), with
// max_tokens reduced by their count. The client sees one stream.

// generation is one proxied client request.
type generation struct {
	s       *Server
	w       http.ResponseWriter
	ctx     context.Context
	path    string
	chat    bool
	stream  bool // the client asked for a stream
	model   string
	req     map[string]any
	maxKey  string
	max     int // -1: the client gave no limit
	id      string
	created int64

	ids        []int // token ids forwarded so far
	untracked  bool  // text was forwarded without its token id: replay impossible
	text       strings.Builder
	finish     any // finish_reason of the final chunk
	usage      map[string]any
	sent       bool // stream headers written to the client
	attempt    int
	startIDs   int  // len(ids) when the current attempt began
	roleSent   bool // the assistant role went to the client
	finishSent bool // a chunk with finish_reason went to the client
}

// attemptResult says how one route attempt ended.
type attemptResult struct {
	done      bool
	clientErr *upstreamError // a 4xx from the head about the request itself
	failHop   string         // the peer to ban
	failMsg   string
	writeErr  error // the client went away
}

type upstreamError struct {
	status int
	body   []byte
}

func (s *Server) proxy(path string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
		if err != nil {
			s.writeError(w, errf(413, "invalid_request_error", "request body larger than %d bytes or unreadable", s.cfg.MaxBodyBytes))
			return
		}
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		var req map[string]any
		if err := dec.Decode(&req); err != nil || req == nil {
			s.writeError(w, errf(400, "invalid_request_error", "request body must be a JSON object"))
			return
		}
		g := &generation{s: s, w: w, ctx: r.Context(), path: path, chat: path == "/v1/chat/completions", req: req, max: -1,
			created: s.cfg.Clock().Unix()}
		if err := g.parse(); err != nil {
			s.writeError(w, err)
			return
		}
		g.run()
	}
}

func intField(v any) (int, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(n.String())
	return i, err == nil
}

func (g *generation) parse() error {
	if v, ok := g.req["model"]; ok {
		m, ok := v.(string)
		if !ok {
			return errf(400, "invalid_request_error", "model must be a string")
		}
		g.model = m
	}
	if v, ok := g.req["stream"]; ok {
		b, ok := v.(bool)
		if !ok {
			return errf(400, "invalid_request_error", "stream must be true or false")
		}
		g.stream = b
	}
	if v, ok := g.req["n"]; ok {
		if n, ok := intField(v); !ok || n != 1 {
			return errf(400, "invalid_request_error", "only n=1 is supported")
		}
	}
	if v, ok := g.req["meshgpu"]; ok {
		// Clients may choose the head's speculation (wire.Speculation);
		// the rest of the field is the tracker's (continue_ids).
		m, ok := v.(map[string]any)
		if !ok {
			return errf(400, "invalid_request_error", "meshgpu must be an object")
		}
		for k, x := range m {
			if k != "speculate" {
				return errf(400, "invalid_request_error", "meshgpu.%s is reserved for the tracker; clients may set only meshgpu.speculate", wire.Truncate(k, 40))
			}
			s, ok := x.(string)
			if !ok {
				return errf(400, "invalid_request_error", "meshgpu.speculate must be a string")
			}
			if _, err := wire.ParseSpeculateMode(s); err != nil {
				return errf(400, "invalid_request_error", "meshgpu.%v", err)
			}
		}
	}
	if g.chat {
		if _, ok := g.req["messages"].([]any); !ok {
			return errf(400, "invalid_request_error", "messages must be a list")
		}
	} else if _, ok := g.req["prompt"]; !ok {
		return errf(400, "invalid_request_error", "prompt is required")
	}
	g.maxKey = "max_tokens"
	if _, ok := g.req["max_completion_tokens"]; ok && g.chat {
		g.maxKey = "max_completion_tokens"
	}
	if v, ok := g.req[g.maxKey]; ok && v != nil {
		n, ok := intField(v)
		if !ok || n < 0 {
			return errf(400, "invalid_request_error", "%s must be a non-negative integer", g.maxKey)
		}
		g.max = n
	}
	model, err := g.s.defaultModel(g.ctx, g.model)
	if err != nil {
		return err
	}
	g.model = model
	seq := g.s.seq.Add(1)
	if g.chat {
		g.id = fmt.Sprintf("chatcmpl-mesh-%d", seq)
	} else {
		g.id = fmt.Sprintf("cmpl-mesh-%d", seq)
	}
	return nil
}

func (g *generation) run() {
	seed := g.s.seq.Add(1) * 0x9e3779b97f4a7c15
	var lastErr error
	for g.attempt = 0; g.attempt < g.s.cfg.MaxAttempts; g.attempt++ {
		if g.ctx.Err() != nil {
			return
		}
		if g.max >= 0 && len(g.ids) >= g.max {
			// Every token came before the failure; only the final chunk
			// is missing.
			g.finish, lastErr = "length", nil
			break
		}
		rt, err := g.s.route(g.ctx, g.model, seed+uint64(g.attempt))
		if err != nil {
			lastErr = err
			break
		}
		release := g.s.reg.Acquire(rt)
		res := g.try(rt)
		release()
		switch {
		case res.writeErr != nil || g.ctx.Err() != nil:
			g.s.proxied.WithLabelValues("client_gone").Inc()
			return
		case res.done:
			g.finishOK()
			return
		case res.clientErr != nil:
			g.s.proxied.WithLabelValues("client_error").Inc()
			g.passError(res.clientErr)
			return
		}
		g.s.reg.Ban(res.failHop, g.s.cfg.BanDuration)
		g.s.log.Warn("tracker proxy: route failed, banning node and replaying",
			"peer", res.failHop, "reason", res.failMsg, "tokens_so_far", len(g.ids), "attempt", g.attempt+1)
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
		g.finishOK()
		return
	}
	g.s.proxied.WithLabelValues("failed").Inc()
	if lastErr == nil {
		lastErr = errf(502, "upstream_error", "generation did not finish")
	}
	var ae *apiError
	if !errors.As(lastErr, &ae) {
		ae = errf(500, "server_error", "%v", lastErr)
	}
	if g.sent {
		g.writeEvent(errorBody(ae.typ, ae.msg, ""))
		return
	}
	g.s.writeError(g.w, ae)
}

// try runs one route attempt.
func (g *generation) try(rt route.Route) attemptResult {
	head := rt.Hops[0]
	g.startIDs = len(g.ids)
	up := make(map[string]any, len(g.req)+2)
	for k, v := range g.req {
		up[k] = v
	}
	up["stream"] = true
	up["model"] = g.model
	if len(g.ids) > 0 {
		ext := map[string]any{"continue_ids": g.ids}
		if m, ok := g.req["meshgpu"].(map[string]any); ok {
			for k, v := range m { // the client's meshgpu.speculate, as written
				ext[k] = v
			}
		}
		up["meshgpu"] = ext
		if g.max >= 0 {
			up[g.maxKey] = g.max - len(g.ids)
		}
	}
	body, err := json.Marshal(up)
	if err != nil {
		return attemptResult{clientErr: &upstreamError{400, []byte(`{"error":{"message":"request cannot be re-encoded","type":"invalid_request_error"}}`)}}
	}
	hops, _ := json.Marshal(rt.Hops[1:])

	ctx, cancel := context.WithCancel(g.ctx)
	defer cancel()
	var timedOut atomic.Bool
	timer := time.AfterFunc(g.s.cfg.FirstByte, func() { timedOut.Store(true); cancel() })
	defer timer.Stop()

	var req *http.Request
	if head.Endpoint != "" {
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(head.Endpoint, "/")+g.path, bytes.NewReader(body))
	} else {
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, "http://relay.invalid"+g.path, bytes.NewReader(body))
	}
	if err != nil {
		return attemptResult{failHop: head.PeerID, failMsg: err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set(wire.HeaderRoute, string(hops))
	req.Header.Set(wire.HeaderEndLayer, strconv.Itoa(head.EndLayer))
	var resp *http.Response
	switch {
	case head.Endpoint != "":
		resp, err = g.s.cfg.HTTPClient.Do(req)
	case g.s.cfg.Relay != nil && head.RelayAddr != "":
		resp, err = g.s.cfg.Relay.Do(ctx, head.RelayAddr, req)
	default:
		err = errors.New("head is relay-only and the tracker has no relay client")
	}
	if err != nil {
		if timedOut.Load() {
			err = fmt.Errorf("no response within %v", g.s.cfg.FirstByte)
		}
		return attemptResult{failHop: head.PeerID, failMsg: err.Error()}
	}
	defer resp.Body.Close()
	timer.Reset(g.s.cfg.TokenTimeout)

	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		hop, msg := parseUpstreamError(b)
		if resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != 408 && resp.StatusCode != 429 {
			return attemptResult{clientErr: &upstreamError{resp.StatusCode, b}}
		}
		return attemptResult{failHop: g.hopPeer(rt, hop), failMsg: fmt.Sprintf("HTTP %d: %s", resp.StatusCode, msg)}
	}

	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var data []string
	for sc.Scan() {
		timer.Reset(g.s.cfg.TokenTimeout)
		line := sc.Text()
		switch {
		case line == "":
			if len(data) == 0 {
				continue
			}
			ev := strings.Join(data, "\n")
			data = data[:0]
			if ev == "[DONE]" {
				return attemptResult{done: true}
			}
			if res, stop := g.event(rt, ev); stop {
				return res
			}
		case strings.HasPrefix(line, "data:"):
			data = append(data, strings.TrimPrefix(strings.TrimPrefix(line, "data:"), " "))
		}
	}
	// The stream ended without [DONE]: finished if the final chunk came.
	if g.finish != nil && !timedOut.Load() {
		return attemptResult{done: true}
	}
	msg := "stream ended before the generation finished"
	if timedOut.Load() {
		msg = fmt.Sprintf("no stream event within %v", g.s.cfg.TokenTimeout)
	} else if err := sc.Err(); err != nil {
		msg = "stream broke: " + err.Error()
	}
	return attemptResult{failHop: head.PeerID, failMsg: msg}
}

// event handles one SSE data payload; stop ends the attempt.
func (g *generation) event(rt route.Route, ev string) (attemptResult, bool) {
	dec := json.NewDecoder(strings.NewReader(ev))
	dec.UseNumber()
	var chunk map[string]any
	if err := dec.Decode(&chunk); err != nil || chunk == nil {
		return attemptResult{failHop: rt.Hops[0].PeerID, failMsg: "head sent an event that is not a JSON object"}, true
	}
	if e, ok := chunk["error"]; ok {
		b, _ := json.Marshal(map[string]any{"error": e})
		hop, msg := parseUpstreamError(b)
		return attemptResult{failHop: g.hopPeer(rt, hop), failMsg: msg}, true
	}
	tok, hasTok := -1, false
	if m, ok := chunk["meshgpu"].(map[string]any); ok {
		tok, hasTok = intField(m["token"])
	}
	// The head's extension field passes on with only the token id: OpenAI
	// clients ignore it, and a client can check ids across a failover.
	delete(chunk, "meshgpu")
	if hasTok {
		chunk["meshgpu"] = map[string]any{"token": tok}
	}
	chunk["id"], chunk["created"], chunk["model"] = g.id, g.created, g.model

	content, finish, droppedRole := "", any(nil), false
	if choices, ok := chunk["choices"].([]any); ok && len(choices) > 0 {
		if c, ok := choices[0].(map[string]any); ok {
			if g.chat {
				if d, ok := c["delta"].(map[string]any); ok {
					content, _ = d["content"].(string)
					if _, ok := d["role"]; ok {
						if g.roleSent {
							delete(d, "role") // a replay's head opens again
							droppedRole = true
						}
						g.roleSent = true
					}
				}
			} else {
				content, _ = c["text"].(string)
			}
			if f, ok := c["finish_reason"]; ok && f != nil {
				finish = f
			}
		}
	}
	if u, ok := chunk["usage"].(map[string]any); ok && u != nil {
		g.fixUsage(u)
		g.usage = u
	}
	if hasTok {
		g.ids = append(g.ids, tok)
	} else if content != "" {
		g.untracked = true
	}
	if finish != nil {
		g.finish = finish
		g.finishSent = g.stream
	}
	if droppedRole && !hasTok && content == "" && finish == nil && chunk["usage"] == nil {
		return attemptResult{}, false // a replay's role-only opening chunk
	}
	g.text.WriteString(content)
	if g.stream {
		if err := g.writeEvent(chunk); err != nil {
			return attemptResult{writeErr: err}, true
		}
	}
	return attemptResult{}, false
}

// fixUsage restates a replay's usage for the original request: the head
// counts the original prompt as prompt_tokens and only its new tokens as
// completion_tokens (docs/protocol.md, "Proxy support"), so the continued
// ids are added to completion and total.
func (g *generation) fixUsage(u map[string]any) {
	cont := g.startIDs
	if cont == 0 {
		return
	}
	for _, k := range []string{"completion_tokens", "total_tokens"} {
		if n, ok := intField(u[k]); ok {
			u[k] = n + cont
		}
	}
}

func (g *generation) writeEvent(v any) error {
	if !g.sent {
		h := g.w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Accel-Buffering", "no")
		g.w.WriteHeader(200)
		g.sent = true
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(g.w, "data: %s\n\n", b); err != nil {
		return err
	}
	if f, ok := g.w.(http.Flusher); ok {
		f.Flush()
	}
	return nil
}

func (g *generation) finishOK() {
	g.s.proxied.WithLabelValues("ok").Inc()
	if g.stream {
		if !g.finishSent {
			choice := map[string]any{"index": 0, "finish_reason": g.finish}
			if g.finish == nil {
				choice["finish_reason"] = "stop"
			}
			if g.chat {
				choice["delta"] = map[string]any{}
			} else {
				choice["text"] = ""
			}
			g.writeEvent(map[string]any{"id": g.id, "object": g.object(), "created": g.created, "model": g.model, "choices": []any{choice}})
		}
		fmt.Fprint(g.w, "data: [DONE]\n\n")
		if f, ok := g.w.(http.Flusher); ok {
			f.Flush()
		}
		return
	}
	finish := g.finish
	if finish == nil {
		finish = "stop"
	}
	choice := map[string]any{"index": 0, "finish_reason": finish}
	if g.chat {
		choice["message"] = map[string]any{"role": "assistant", "content": g.text.String()}
	} else {
		choice["text"] = g.text.String()
	}
	out := map[string]any{"id": g.id, "object": g.object(), "created": g.created, "model": g.model, "choices": []any{choice}}
	usage := map[string]any{"completion_tokens": len(g.ids)}
	if g.usage != nil {
		usage = g.usage
	}
	out["usage"] = usage
	writeJSON(g.w, 200, out)
}

func (g *generation) object() string {
	switch {
	case g.chat && g.stream:
		return "chat.completion.chunk"
	case g.chat:
		return "chat.completion"
	default:
		return "text_completion"
	}
}

// passError forwards a head's 4xx about the request itself.
func (g *generation) passError(e *upstreamError) {
	_, msg := parseUpstreamError(e.body)
	if g.sent {
		g.writeEvent(errorBody("invalid_request_error", msg, ""))
		return
	}
	writeJSON(g.w, e.status, errorBody("invalid_request_error", msg, ""))
}

// parseUpstreamError reads {"error":{"message","type","hop"}}.
func parseUpstreamError(b []byte) (hop, msg string) {
	var e struct {
		Error struct {
			Message string `json:"message"`
			Hop     string `json:"hop"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) != nil || e.Error.Message == "" {
		s := strings.TrimSpace(string(b))
		if len(s) > 200 {
			s = s[:200]
		}
		return "", "unrecognized error body: " + s
	}
	return e.Error.Hop, e.Error.Message
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
