package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"meshgpu/hopmux"
	"meshgpu/wire"
)

// AcceptHop implements hopmux.Handler: direct hop connections and the
// relay tunnel hand every Hop frame to it. The payload goes straight into a
// host buffer (pinned on CUDA); a step the scheduler runs alone runs in
// place on it, one batched with others is gathered into the scheduler's
// buffer and its rows copied back (sched.Scheduler.forward); the reply is
// written from the answer's own buffer.
func (s *Server) AcceptHop(ctx context.Context, h *wire.HopHead) hopmux.Hop {
	return s.acceptHop(ctx, h, func() {})
}

// acceptHop is AcceptHop calling release once the hop is refused or done
// (Shards: the hop holds s until then).
func (s *Server) acceptHop(ctx context.Context, h *wire.HopHead, release func()) hopmux.Hop {
	s.once.Do(s.init)
	start := time.Now()
	refuse := func(ae *apiError) hopmux.Hop {
		release()
		return hopmux.Refuse(s.refuseHop(ae, h, start))
	}
	if s.initErr != nil {
		return refuse(&apiError{Status: http.StatusServiceUnavailable, Type: "not_ready", Message: s.initErr.Error()})
	}
	select {
	case s.inflight <- struct{}{}:
	default:
		return refuse(&apiError{Status: http.StatusTooManyRequests, Type: "overloaded",
			Message: fmt.Sprintf("this node is serving its maximum of %d hops at once; retry later", cap(s.inflight))})
	}
	if h.Binding != nil {
		s.metrics.bindingReceived()
	}
	req, ae := frameHopRequest(h, s.shardInfo())
	if ae != nil {
		<-s.inflight
		return refuse(ae)
	}
	need := h.PayloadLen()
	if need > s.MaxBodyBytes {
		<-s.inflight
		return refuse(&apiError{Status: http.StatusRequestEntityTooLarge, Type: "body_too_large",
			Message: fmt.Sprintf("hop body of %d bytes is over this node's limit of %d bytes", need, s.MaxBodyBytes)})
	}
	wait := time.Now().Add(s.HopTimeout)
	if !req.deadline.IsZero() && req.deadline.Before(wait) {
		wait = req.deadline
	}
	hb, ae := s.hostBuffer(ctx, int(need), withMargin(wait))
	if ae != nil {
		<-s.inflight
		return refuse(ae)
	}
	serve := func(ctx context.Context, ok bool) *wire.HopReply {
		defer release()
		defer func() { <-s.inflight }()
		if !ok {
			s.hosts.put(hb)
			s.metrics.hopDone("bad_body", time.Since(start))
			return nil
		}
		ans, ae := s.runHop(ctx, req, hb.Bytes)
		if ae != nil {
			s.hosts.put(hb)
			return s.refuseHop(ae, h, start)
		}
		s.metrics.hopDone("ok", time.Since(start))
		rep := ans.reply()
		rep.Release = func() { ans.done(); s.hosts.put(hb) }
		return rep
	}
	return hopmux.Accept(hb.Bytes, serve)
}

// reply is the answer as a HopReply (its payload is not copied).
func (a *hopAnswer) reply() *wire.HopReply {
	if a.token != nil {
		return &wire.HopReply{Status: http.StatusOK, Kind: wire.ReplyToken, Token: a.token.Token, Logprob: a.token.Logprob, Logprobs: a.token.Logprobs}
	}
	if a.tokens != nil {
		return &wire.HopReply{Status: http.StatusOK, Kind: wire.ReplyTokens, Tokens: a.tokens}
	}
	return &wire.HopReply{Status: http.StatusOK, Kind: wire.ReplyActivations, EndLayer: a.endLayer,
		NTokens: a.nTokens, Hidden: a.hidden, DType: wireDType(a.dtype), Payload: a.payload}
}

// refuseHop is a hop's error as a HopReply with POST /forward's body.
func (s *Server) refuseHop(ae *apiError, h *wire.HopHead, start time.Time) *wire.HopReply {
	if ae.Hop == "" {
		ae.Hop = s.selfName()
	}
	if s.metrics != nil {
		s.metrics.hopDone(ae.Type, time.Since(start))
	}
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	if ae.Status >= 500 {
		log.Warn("hop failed", "status", ae.Status, "type", ae.Type, "error", ae.Message, "hop", ae.Hop, "session", h.Session)
	} else {
		log.Debug("hop rejected", "status", ae.Status, "type", ae.Type, "error", ae.Message)
	}
	b, _ := json.Marshal(errorBody{Error: ae.wire()})
	return &wire.HopReply{Status: ae.Status, Kind: wire.ReplyError, Body: b}
}
