package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// hopCall is one hop to send: the per-token head and the session's binding.
type hopCall struct {
	session         string
	nTokens, hidden int
	dtype           native.DType
	pos, step       int
	tokens          []int32 // ids at the hop's positions (repetition penalty or verify)
	verify          bool    // a verify hop (tokens: last accepted, then drafts)
	pass            wire.PassOrder
	parents         []int32 // a verify hop's token tree (wire/tree.go); nil: a chain
	keep            []int32 // cache slots to move to pos-len(keep).. first (wire/tree.go)
	params          sample.Params
	ticket          []byte
	// rebind sends the binding even when the next hop acknowledged it.
	rebind bool
	// sess remembers which binding the next hop holds; nil: always bind.
	sess *session
}

// RelayHopper is a RelayDoer that also carries hop frames through the
// relay tunnel (relay.Client); it returns wire.ErrHopFramesUnsupported
// when the relay or the peer does not.
type RelayHopper interface {
	DoHop(ctx context.Context, relayAddr string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error)
}

// sendHop sends body to hop with rest as its route, retrying once on a
// transport failure, a timeout or a 500/503. deadline bounds both attempts;
// zero gives each attempt its own HopTimeout (the head's per-token hop). The
// retry uses the same position, which the receiver treats as a redo, so no
// token is skipped or duplicated, and it carries the session's binding
// again (a failover may have changed the node behind the address).
func (s *Server) sendHop(ctx context.Context, hop wire.Hop, rest []wire.Hop, c hopCall, body []byte, deadline time.Time) (*hopAnswer, *apiError) {
	var last *apiError
	forceBind := c.rebind || c.sess == nil
	for attempt := 1; attempt <= 2; attempt++ {
		d := deadline
		if d.IsZero() {
			d = time.Now().Add(s.HopTimeout)
		}
		if !time.Now().Before(d) {
			break
		}
		useRelay := hop.RelayAddr != "" && s.Relay != nil && (attempt == 1 || hop.Endpoint == "")
		if !useRelay && hop.Endpoint == "" {
			return nil, &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(),
				Message: "hop has no endpoint and this node has no relay client"}
		}
		// Bound once per path: through the relay tunnel the next node
		// tells senders apart by the peer id the relay names.
		bind := forceBind || attempt > 1 || !c.sess.downBound(hop, rest, c.params)
		// A retry never takes the direct path: the first attempt may have
		// failed on a path whose death the node has not noticed yet.
		direct := attempt == 1
		res, ae := s.hopAttempt(ctx, hop, rest, c, body, d, useRelay, bind, direct)
		lost := false
		if ae != nil && ae.Type == "binding_required" && !bind {
			// The next hop lost our binding (it restarted, or reaped the
			// session's binding): send it again, once, at no retry's cost.
			res, ae = s.hopAttempt(ctx, hop, rest, c, body, d, useRelay, true, direct)
			lost = true
		}
		if c.sess != nil {
			// (a stale pass's refusal says nothing of the binding)
			c.sess.setDown(ae == nil || ae.Type == wire.TypeStalePass, hop, rest, c.params, lost)
		}
		if ae == nil {
			if ae := s.checkAnswer(res, hop); ae != nil {
				res.done()
				return nil, ae
			}
			return res, nil
		}
		last = ae
		// Retry our own transport failures and a downstream 500/503. The
		// head (no fixed deadline) also retries a 502/504 reported from
		// deeper in the chain, whose nodes had no time left to retry.
		retry := ae.transport || ae.Status == 500 || ae.Status == 503 ||
			(deadline.IsZero() && (ae.Status == 502 || ae.Status == 504))
		if ae.Type == wire.TypeRelayUnreachable && (hop.Endpoint == "" || ae.Hop != hop.Name()) {
			// The relay client waited out a short outage already; a
			// second wait would only delay the failover.
			retry = false
		}
		if ctx.Err() != nil || !retry {
			break
		}
		if attempt == 1 {
			s.Logger.Warn("hop failed, retrying once", "hop", hop.Name(), "session", c.session, "position", c.pos, "error", ae.Message)
		}
	}
	if last == nil {
		last = &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Hop: hop.Name(), Message: "no time left for the hop"}
	}
	return nil, last
}

// checkAnswer refuses a token answer holding values no honest sampler
// sends (NaN or positive logprobs, ids outside the vocabulary): a 502
// naming the hop that answered, so the blame, and the tracker's ban, fall
// on it and not on this node, and nothing of it reaches a client. In chain
// mode each node checks its next hop's answer, so the hop named is the one
// that made it.
func (s *Server) checkAnswer(a *hopAnswer, hop wire.Hop) *apiError {
	toks := a.tokens
	if a.token != nil {
		toks = []wire.TokenReply{*a.token}
	}
	for _, t := range toks {
		if err := t.Check(s.cfg.Vocab); err != nil {
			s.metrics.badAnswer()
			s.Logger.Warn("hop answered values no sampler produces", "hop", hop.Name(), "error", err)
			return &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(), Message: err.Error()}
		}
	}
	return nil
}

// hopAttempt sends one hop as a Hop frame (over the node's connection to
// the peer, or the relay tunnel), or as POST /forward to a peer that does
// not speak frames; direct lets it take a proven direct path to a
// relay-only peer.
func (s *Server) hopAttempt(ctx context.Context, hop wire.Hop, rest []wire.Hop, c hopCall, body []byte, d time.Time, useRelay, bind, direct bool) (*hopAnswer, *apiError) {
	actx, cancel := context.WithDeadline(ctx, d)
	defer cancel()
	head := &wire.HopHead{Session: c.session, Position: c.pos, NTokens: c.nTokens, Hidden: c.hidden,
		DType: wireDType(c.dtype), Step: c.step, Deadline: d, Tokens: c.tokens, Verify: c.verify, Pass: c.pass,
		Parents: c.parents, Keep: c.keep}
	if bind {
		head.Binding = &wire.Binding{StartLayer: hop.StartLayer, EndLayer: hop.EndLayer, Route: rest, Sampling: c.params, Ticket: c.ticket}
	}
	start := time.Now()
	var rep *wire.HopReply
	err := wire.ErrHopFramesUnsupported
	if s.DisableHopFrames {
		// protocol version 1 only: POST /forward, direct or relayed
	} else if dc, kind := s.directPath(hop, useRelay && direct); dc != nil {
		// A proven direct path to a relay-only peer (node/directpath.go);
		// if it dies under this hop, the retry goes through the relay.
		rep, err = dc.roundTrip(actx, head, body, s.replyBuffer)
		s.metrics.hopPath(hop.PeerID, kind)
	} else if useRelay {
		if rh, ok := s.Relay.(RelayHopper); ok {
			rep, err = rh.DoHop(actx, hop.RelayAddr, head, body, s.replyBuffer)
			s.metrics.hopPath(hop.PeerID, "relay")
		}
	} else if s.peers != nil {
		rep, err = s.peers.doPeer(actx, hop.Endpoint, hop.PeerID, head, body, s.replyBuffer)
		s.metrics.hopPath(hop.PeerID, "tcp")
	}
	switch {
	case errors.Is(err, wire.ErrHopFramesUnsupported):
		return s.httpHopAttempt(ctx, actx, hop, rest, c, body, d, useRelay)
	case errors.Is(err, wire.ErrHopEncode):
		// Nothing was sent: what does not fit is the request's (requests
		// are checked against the hop limits when parsed, so this is a
		// last line), never the next hop's failure.
		return nil, &apiError{Status: http.StatusBadRequest, Type: wire.TypeInvalidRequest,
			Message: fmt.Sprintf("the request does not fit the hop protocol: %v", err)}
	case err != nil:
		return nil, s.transportError(ctx, actx, hop, err, time.Since(start))
	}
	return answerOf(rep, hop)
}

// directPath is the proven direct path for a hop that would go through
// the relay and its path label, or nil (and then one is punched for the
// next hops).
func (s *Server) directPath(hop wire.Hop, useRelay bool) (*hopConn, string) {
	if !useRelay || s.Direct == nil {
		return nil, ""
	}
	return s.Direct.conn(hop.PeerID, hop.RelayAddr)
}

// replyBuffer lends activations replies a host buffer when one is free at
// once (a connection's reader never waits for memory), else Go memory.
func (s *Server) replyBuffer(n int) ([]byte, func(), error) {
	if hb := s.hosts.tryGet(n); hb != nil {
		return hb.Bytes, func() { s.hosts.put(hb) }, nil
	}
	return make([]byte, n), nil, nil
}

// answerOf turns a HopReply into the hop's answer or its error.
func answerOf(rep *wire.HopReply, hop wire.Hop) (*hopAnswer, *apiError) {
	switch {
	case rep.Kind == wire.ReplyError && rep.Status >= 400:
		return nil, decodeErrorBody(rep.Status, rep.Body, hop.Name())
	case rep.Status != http.StatusOK:
		rep.ReleaseBuffer()
		return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(),
			Message: fmt.Sprintf("hop answered status %d with a reply of kind %d", rep.Status, rep.Kind)}
	case rep.Kind == wire.ReplyToken:
		return &hopAnswer{token: &wire.TokenReply{Token: rep.Token, Logprob: rep.Logprob, Logprobs: rep.Logprobs}}, nil
	case rep.Kind == wire.ReplyTokens:
		return &hopAnswer{tokens: rep.Tokens}, nil
	}
	dt := native.BF16
	if rep.DType == wire.DTypeF32 {
		dt = native.F32
	}
	return &hopAnswer{endLayer: rep.EndLayer, nTokens: rep.NTokens, hidden: rep.Hidden, dtype: dt, payload: rep.Payload, release: rep.Release}, nil
}

// httpHopAttempt is the hop as POST /forward (protocol version 1): every
// header every time, for nodes that do not speak hop frames.
func (s *Server) httpHopAttempt(ctx, actx context.Context, hop wire.Hop, rest []wire.Hop, c hopCall, body []byte, d time.Time, useRelay bool) (*hopAnswer, *apiError) {
	if c.parents != nil || c.keep != nil {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "hop_unsupported", Hop: hop.Name(),
			Message: "the next hop takes no Hop frames, and POST /forward carries no token trees; decode with chain drafts"}
	}
	base := strings.TrimRight(hop.Endpoint, "/")
	if base == "" {
		base = relayOnlyBase(hop) // the relay carries only the path
	}
	// body is a lent host buffer; http.Transport copies it into its
	// socket buffer, and the fence stops it reading once this attempt is
	// over (the buffer goes back to the pool).
	fence := &bodyFence{b: body}
	defer fence.fence()
	req, err := http.NewRequestWithContext(identity.WithPeerID(actx, hop.PeerID), http.MethodPost, base+"/forward", fence.reader())
	if err != nil {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(), Message: err.Error()}
	}
	req.ContentLength = int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return fence.reader(), nil }
	h := req.Header
	h.Set("Content-Type", "application/octet-stream")
	h.Set(wire.HeaderSession, c.session)
	h.Set(wire.HeaderShape, strconv.Itoa(c.nTokens)+","+strconv.Itoa(c.hidden))
	h.Set(wire.HeaderDType, c.dtype.String())
	h.Set(wire.HeaderStartLayer, strconv.Itoa(hop.StartLayer))
	h.Set(wire.HeaderEndLayer, strconv.Itoa(hop.EndLayer))
	h.Set(wire.HeaderPosition, strconv.Itoa(c.pos))
	h.Set(wire.HeaderHopDeadline, strconv.FormatInt(d.UnixMilli(), 10))
	if len(rest) > 0 {
		rj, err := json.Marshal(rest)
		if err != nil {
			return nil, asAPIError(err)
		}
		h.Set(wire.HeaderRoute, string(rj))
	}
	sj, err := json.Marshal(wire.Sampling{SamplingParams: c.params, Step: c.step, Tokens: c.tokens})
	if err != nil {
		return nil, asAPIError(err)
	}
	h.Set(wire.HeaderSampling, string(sj))
	if len(c.ticket) > 0 {
		h.Set(wire.HeaderTicket, ticket.String(c.ticket))
	}
	if c.verify {
		h.Set(wire.HeaderVerify, "1")
	}
	if c.pass.Set() {
		h.Set(wire.HeaderPass, c.pass.String())
	}
	start := time.Now()
	var resp *http.Response
	if useRelay {
		resp, err = s.Relay.Do(actx, hop.RelayAddr, req)
	} else {
		resp, err = s.client.Do(req)
	}
	if err != nil {
		return nil, s.transportError(ctx, actx, hop, err, time.Since(start))
	}
	defer resp.Body.Close()
	limit := int64(c.nTokens)*int64(c.hidden)*4 + 1<<20
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, s.transportError(ctx, actx, hop, err, time.Since(start))
	}
	if int64(len(data)) > limit {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(),
			Message: fmt.Sprintf("hop answered more than %d bytes", limit)}
	}
	if resp.StatusCode != http.StatusOK {
		if resp.StatusCode < 400 { // a redirect or an empty 2xx is no hop answer
			return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(),
				Message: fmt.Sprintf("hop answered %s; want 200 or an error", resp.Status)}
		}
		return nil, decodeErrorBody(resp.StatusCode, data, hop.Name())
	}
	return httpAnswer(resp.Header, data, hop, c.verify)
}

// httpAnswer reads a POST /forward 200: a token JSON or activations.
func httpAnswer(h http.Header, data []byte, hop wire.Hop, verify bool) (*hopAnswer, *apiError) {
	bad := func(format string, args ...any) *apiError {
		return &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(), Message: fmt.Sprintf(format, args...)}
	}
	if strings.HasPrefix(h.Get("Content-Type"), "application/json") && verify {
		var v wire.VerifyReply
		if err := json.Unmarshal(data, &v); err != nil {
			return nil, bad("verify JSON: %v", err)
		}
		if len(v.Tokens) == 0 {
			return nil, bad("verify JSON: no tokens")
		}
		return &hopAnswer{tokens: v.Tokens}, nil
	}
	if strings.HasPrefix(h.Get("Content-Type"), "application/json") {
		var t wire.TokenReply
		if err := json.Unmarshal(data, &t); err != nil {
			return nil, bad("token JSON: %v", err)
		}
		return &hopAnswer{token: &t}, nil
	}
	n, hidden, err := wire.ParseShape(h.Get(wire.HeaderShape))
	if err != nil {
		return nil, bad("%s: %v", wire.HeaderShape, err)
	}
	dt := native.BF16
	if strings.EqualFold(h.Get(wire.HeaderDType), "f32") {
		dt = native.F32
	}
	end, err := strconv.Atoi(h.Get(wire.HeaderEndLayer))
	if err != nil || end < 0 || end > wire.MaxLayerIndex {
		return nil, bad("%s: want a layer, got %q", wire.HeaderEndLayer, wire.Truncate(h.Get(wire.HeaderEndLayer), 20))
	}
	if len(data) != n*hidden*dt.Size() {
		return nil, bad("activations of %d bytes for shape %d,%d of %s", len(data), n, hidden, dt)
	}
	return &hopAnswer{endLayer: end, nTokens: n, hidden: hidden, dtype: dt, payload: data}, nil
}

func (s *Server) transportError(ctx, actx context.Context, hop wire.Hop, err error, took time.Duration) *apiError {
	switch {
	case ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded):
		return &apiError{Status: 499, Type: "canceled", Hop: hop.Name(), Message: "request canceled by the client"}
	case errors.Is(actx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) || isTimeout(err):
		return &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Hop: hop.Name(), transport: true,
			Message: fmt.Sprintf("hop to %s did not answer within %v", hop.Name(), took.Round(time.Millisecond))}
	}
	var path interface{ RelayPath() string }
	if errors.As(err, &path) {
		// The relay or the peer's connection to it is down: the tracker
		// routes around the peer without banning it.
		return &apiError{Status: http.StatusBadGateway, Type: wire.TypeRelayUnreachable, Hop: hop.Name(), transport: true,
			Message: fmt.Sprintf("hop to %s failed: %v (is the relay %s up, and the node connected to it?)", hop.Name(), err, path.RelayPath())}
	}
	return &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(), transport: true,
		Message: fmt.Sprintf("hop to %s failed: %v", hop.Name(), err)}
}

// deleteSessions frees the session on every hop of the route (best effort,
// in parallel, bounded by a short timeout); ctx should outlive the request.
func (s *Server) deleteSessions(ctx context.Context, route []wire.Hop, id string, keys [][]byte) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	done := make(chan struct{}, len(route))
	for i, hop := range route {
		go func() {
			defer func() { done <- struct{}{} }()
			base := strings.TrimRight(hop.Endpoint, "/")
			useRelay := hop.RelayAddr != "" && s.Relay != nil
			if base == "" {
				if !useRelay {
					return
				}
				base = relayOnlyBase(hop)
			}
			req, err := http.NewRequestWithContext(identity.WithPeerID(ctx, hop.PeerID), http.MethodDelete, base+"/sessions/"+id, nil)
			if err != nil {
				return
			}
			if i < len(keys) {
				req.Header.Set(wire.HeaderSessionKey, sessionKeyHeader(keys[i]))
			}
			var resp *http.Response
			if useRelay {
				resp, err = s.Relay.Do(ctx, hop.RelayAddr, req)
			} else {
				resp, err = s.client.Do(req)
			}
			if err != nil {
				s.Logger.Debug("freeing session on hop failed", "hop", hop.Name(), "session", id, "error", err)
				return
			}
			io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
		}()
	}
	for range route {
		<-done
	}
}

// relayOnlyBase is a placeholder base URL for a hop reached only through a
// relay; the relay forwards the request's path and headers.
func relayOnlyBase(hop wire.Hop) string {
	if hop.PeerID != "" && wire.ValidSessionID(hop.PeerID) {
		return "http://" + hop.PeerID
	}
	return "http://relay.invalid"
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
