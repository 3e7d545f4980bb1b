package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"time"

	"meshgpu/native"
	"meshgpu/sched"
	"meshgpu/wire"
)

// handleForward serves one hop: validate, run this node's layers for the
// session, then answer activations, forward them down the route (chain
// mode), or sample a token when this node ran the model's last layer.
func (s *Server) handleForward(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	ae := s.serveHop(w, r)
	result := "ok"
	if ae != nil {
		if ae.Hop == "" {
			ae.Hop = s.selfName()
		}
		result = ae.Type
		writeError(w, ae)
		if ae.Status >= 500 {
			s.Logger.Warn("hop failed", "status", ae.Status, "type", ae.Type, "error", ae.Message, "hop", ae.Hop,
				"session", r.Header.Get(wire.HeaderSession))
		} else {
			s.Logger.Debug("hop rejected", "status", ae.Status, "type", ae.Type, "error", ae.Message)
		}
	}
	s.metrics.hopDone(result, time.Since(start))
}

func (s *Server) selfName() string {
	if s.PeerID != "" {
		return s.PeerID
	}
	return "node " + strconv.Itoa(s.cfg.First) + "-" + strconv.Itoa(s.cfg.Last)
}

func (s *Server) serveHop(w http.ResponseWriter, r *http.Request) *apiError {
	select {
	case s.inflight <- struct{}{}:
		defer func() { <-s.inflight }()
	default:
		return &apiError{Status: http.StatusTooManyRequests, Type: "overloaded",
			Message: fmt.Sprintf("this node is serving its maximum of %d hops at once; retry later", cap(s.inflight))}
	}
	// A caller trickling its body must not hold a buffer past the hop's
	// time; the deadline is cleared once the body is in.
	rc := http.NewResponseController(w)
	rc.SetReadDeadline(time.Now().Add(s.HopTimeout))
	req, ae := parseHopRequest(r.Header, s.shardInfo())
	if ae != nil {
		return ae
	}
	need := int64(req.nTokens) * int64(req.hidden) * int64(req.dtype.Size())
	if need > s.MaxBodyBytes || r.ContentLength > s.MaxBodyBytes {
		return &apiError{Status: http.StatusRequestEntityTooLarge, Type: "body_too_large",
			Message: fmt.Sprintf("hop body of %d bytes is over this node's limit of %d bytes", max(need, r.ContentLength), s.MaxBodyBytes)}
	}
	if r.ContentLength >= 0 && r.ContentLength != need {
		return headerError(wire.HeaderShape, "body is %d bytes but shape %d,%d of %s needs %d", r.ContentLength, req.nTokens, req.hidden, req.dtype, need)
	}
	// The body goes straight into a host buffer (pinned on CUDA) and the
	// layers read it there (a batched call copies its rows into the batch,
	// sched); it returns to the pool once the answer is out. Waiting for one is
	// bounded by the hop's deadline, leaving the caller time to retry.
	wait := time.Now().Add(s.HopTimeout)
	if !req.deadline.IsZero() && req.deadline.Before(wait) {
		wait = req.deadline
	}
	hb, ae := s.hostBuffer(r.Context(), int(need), withMargin(wait))
	if ae != nil {
		return ae
	}
	defer s.hosts.put(hb)
	buf := hb.Bytes
	body := http.MaxBytesReader(w, r.Body, s.MaxBodyBytes)
	if n, err := io.ReadFull(body, buf); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &apiError{Status: http.StatusRequestEntityTooLarge, Type: "body_too_large", Message: err.Error()}
		}
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return headerError(wire.HeaderShape, "body is %d bytes but shape %d,%d of %s needs %d", n, req.nTokens, req.hidden, req.dtype, need)
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return &apiError{Status: http.StatusRequestTimeout, Type: "body_timeout",
				Message: fmt.Sprintf("the hop body did not arrive within %v (%d of %d bytes)", s.HopTimeout, n, need)}
		}
		return &apiError{Status: http.StatusBadRequest, Type: "bad_body", Message: "reading hop body: " + err.Error()}
	}
	var one [1]byte
	if n, _ := body.Read(one[:]); n > 0 {
		return headerError(wire.HeaderShape, "body is longer than the %d bytes shape %d,%d of %s needs", need, req.nTokens, req.hidden, req.dtype)
	}
	rc.SetReadDeadline(time.Time{})

	ans, ae := s.runHop(withHopOrigin(r.Context(), hopOrigin{remote: r.RemoteAddr}), req, buf)
	if ae != nil {
		return ae
	}
	defer ans.done()
	ans.writeHTTP(w)
	return nil
}

// hopAnswer is a hop's outcome: the sampled token, or activations (this
// node's, in the hop's own buffer, or the chain's, in a buffer release
// returns).
type hopAnswer struct {
	token           *wire.TokenReply
	tokens          []wire.TokenReply // a verify hop's accepted tokens plus one
	endLayer        int
	nTokens, hidden int
	dtype           native.DType
	payload         []byte
	release         func()
}

func (a *hopAnswer) done() {
	if a.release != nil {
		a.release()
		a.release = nil
	}
}

// writeHTTP answers POST /forward (docs/protocol.md, Responses).
func (a *hopAnswer) writeHTTP(w http.ResponseWriter) {
	if a.token != nil {
		writeJSON(w, http.StatusOK, a.token)
		return
	}
	if a.tokens != nil {
		writeJSON(w, http.StatusOK, wire.VerifyReply{Tokens: a.tokens})
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set(wire.HeaderShape, strconv.Itoa(a.nTokens)+","+strconv.Itoa(a.hidden))
	h.Set(wire.HeaderDType, a.dtype.String())
	h.Set(wire.HeaderEndLayer, strconv.Itoa(a.endLayer))
	h.Set("Content-Length", strconv.Itoa(len(a.payload)))
	w.WriteHeader(http.StatusOK)
	w.Write(a.payload)
}

// runHop runs a validated hop whose payload is in buf, whichever transport
// brought it: this node's layers, then the token (last layer), the chain's
// answer (a route follows), or the activations.
func (s *Server) runHop(ctx context.Context, req *hopRequest, buf []byte) (*hopAnswer, *apiError) {
	deadline := time.Now().Add(s.HopTimeout)
	if !req.deadline.IsZero() && req.deadline.Before(deadline) {
		deadline = req.deadline
	}
	if !time.Now().Before(deadline) {
		return nil, &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Message: "the hop deadline passed before this node started"}
	}
	if dl, ok := ctx.Deadline(); !ok || dl.After(deadline) { // (a caller may have set an earlier one)
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}

	ans, sess, ae := s.computeHop(ctx, req, buf)
	if ae != nil {
		return nil, ae
	}
	if ans != nil {
		return ans, nil
	}
	if len(req.route) > 0 {
		call := hopCall{session: req.session, nTokens: req.nTokens, hidden: req.hidden, dtype: req.dtype,
			pos: req.pos, step: req.step, tokens: req.tokens, verify: req.verify, pass: req.pass, parents: req.parents, keep: req.keep,
			params: req.params, ticket: req.ticket, rebind: req.rebind, sess: sess}
		// Answer before our caller's deadline so it hears which hop failed.
		return s.sendHop(ctx, req.route[0], req.route[1:], call, buf, withMargin(deadline))
	}
	return &hopAnswer{endLayer: req.end, nTokens: req.nTokens, hidden: req.hidden, dtype: req.dtype, payload: buf}, nil
}

// computeHop binds the session (the hop's own binding, or the one stored
// for it), runs layers start..end in place on buf and, on the node with
// the last layer, samples the next token (a verify hop: verifies the drafts).
func (s *Server) computeHop(ctx context.Context, req *hopRequest, buf []byte) (*hopAnswer, *session, *apiError) {
	// A binding is checked against the node's trust before it may create
	// a session; an unbound hop creates nothing (node/tickets.go).
	origin := originOf(ctx)
	var grant *hopGrant
	var sess *session
	if req.rebind {
		g, ae := s.authorizeBinding(req, origin)
		if ae != nil {
			return nil, nil, ae
		}
		grant = g
		if sess, ae = s.sessions.get(req.session, req.pos); ae != nil {
			return nil, nil, ae
		}
	} else if sess = s.sessions.lookup(req.session); sess == nil {
		if req.pos > 0 {
			return nil, nil, &apiError{Status: http.StatusNotFound, Type: "unknown_session",
				Message: fmt.Sprintf("session %q is not on this node (expired, deleted, or never started at position 0); got position %d", req.session, req.pos)}
		}
		return nil, nil, errUnbound(req.session)
	}
	if sess.local.Load() {
		return nil, nil, forbidden("session_owned", "session %s is driven by this node", req.session)
	}
	if err := sess.acquire(ctx); err != nil {
		if errors.Is(err, context.Canceled) { // (a head dropping a pass in flight)
			return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "the hop was canceled by its sender"}
		}
		return nil, nil, &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout",
			Message: "timed out waiting for the previous hop of session " + req.session}
	}
	held := true // (awaitPass lets the lock go while it waits)
	defer func() {
		if held {
			sess.release()
		}
	}()
	if sess.closed {
		return nil, nil, &apiError{Status: http.StatusNotFound, Type: "unknown_session", Message: "session " + req.session + " was deleted"}
	}
	if ae := ticketLive(sess, time.Now()); ae != nil {
		s.sessions.drop(sess)
		return nil, nil, ae
	}
	switch {
	case req.rebind:
		if ae := s.claim(sess, grant, origin); ae != nil {
			return nil, nil, ae
		}
		if b := sess.binding; b == nil || b.StartLayer != req.start || b.EndLayer != req.end || !slices.Equal(b.Route, req.route) || !b.Sampling.Equal(req.params) || !bytes.Equal(b.Ticket, req.ticket) {
			sess.binding = req.binding()
		}
	case sess.binding == nil:
		return nil, nil, errUnbound(req.session)
	default:
		if ae := checkUnbound(sess, origin); ae != nil {
			return nil, nil, ae
		}
		b := sess.binding
		req.bound, req.start, req.end, req.route, req.params, req.ticket = true, b.StartLayer, b.EndLayer, b.Route, b.Sampling, b.Ticket
	}
	if req.pass.Set() || sess.lastPass > 0 {
		var ae *apiError
		if held, ae = sess.awaitPass(ctx, req.pass); ae != nil {
			return nil, nil, ae
		}
	}
	// every hop ends the last one's tree; one with Keep keeps its branch
	if ae := sess.keepBranch(req.pos-len(req.keep), req.keep); ae != nil {
		return nil, nil, ae
	}
	if n := sess.kv.Len(); req.pos > n {
		return nil, nil, &apiError{Status: http.StatusConflict, Type: "position_mismatch",
			Message: fmt.Sprintf("%s: position %d but session %s holds %d tokens; send position %d (or lower to redo)", wire.HeaderPosition, req.pos, req.session, n, n)}
	}
	if !inRange(buf, req.dtype == native.BF16) {
		// Counted against the sender, whom the error names: the head or the
		// tracker routes around it as after any failed hop. The session
		// goes at once: its route has failed, and a retry binds anew.
		s.metrics.nonFiniteHop()
		sender := sess.prev
		if sender == "" {
			sender = "sender at " + origin.remote
		}
		s.sessions.drop(sess)
		typ, what := "activations_out_of_range", fmt.Sprintf("values of magnitude %d or more (no model produces them)", maxActivation)
		if hasNonFinite(buf, req.dtype == native.BF16) {
			typ, what = "non_finite_activations", "NaN or Inf"
		}
		s.Logger.Warn("hop with bad activations refused", "session", req.session, "sender", sender, "remote", origin.remote, "type", typ)
		return nil, nil, &apiError{Status: http.StatusUnprocessableEntity, Type: typ, Hop: sender,
			Message: fmt.Sprintf("the activations sent to %s for layers %d-%d hold %s", s.selfName(), req.start, req.end, what)}
	}
	t0 := time.Now()
	if req.end == s.cfg.NumLayers-1 && !req.verify && req.parents == nil {
		if smp := s.backendSample(sess, req.params, req.pos, req.nTokens, req.tokens, req.step); smp != nil {
			return s.sampleHop(ctx, req, sess, buf, smp, t0)
		}
	}
	var logits []float32
	if req.end == s.cfg.NumLayers-1 {
		rows := 1
		if req.verify {
			rows = req.nTokens
		}
		logits = make([]float32, rows*s.cfg.Vocab)
	}
	err := s.runTreeStage(ctx, sess.kv, req.start, req.end, req.pos, req.nTokens, nil, req.parents, req.dtype, buf, logits)
	if req.parents != nil && err == nil {
		sess.tree.pos, sess.tree.rows = req.pos, req.nTokens
	}
	if err != nil {
		s.metrics.computeDone(time.Since(t0))
		return nil, nil, backendError(err)
	}
	sess.passRan(req.pass)
	if logits == nil {
		s.metrics.computeDone(time.Since(t0))
		return nil, sess, nil
	}
	if len(req.tokens) > 0 {
		sess.recordTokens(req.pos, req.tokens)
	}
	if req.verify {
		if len(req.params.ResponseFormat) > 0 {
			s.metrics.computeDone(time.Since(t0))
			return nil, nil, &apiError{Status: http.StatusBadRequest, Type: "invalid_verify",
				Message: "a verify hop cannot carry a response format (its mask is applied one step at a time); send one token per hop"}
		}
		toks := verifyPass(logits, s.cfg.Vocab, req.tokens, req.parents, req.params, sess, req.pos, req.step)
		s.metrics.computeDone(time.Since(t0))
		for range toks {
			s.metrics.tokenGenerated()
		}
		ans := &hopAnswer{tokens: toks}
		s.pushReply(sess, req, ans)
		return ans, sess, nil
	}
	id, lp, lps, ae := s.sampleWithHistory(logits, req.params, sess, req.step)
	s.metrics.computeDone(time.Since(t0))
	if ae != nil {
		return nil, nil, ae
	}
	s.metrics.tokenGenerated()
	ans := &hopAnswer{token: &wire.TokenReply{Token: id, Logprob: lp, Logprobs: lps}}
	s.pushReply(sess, req, ans)
	return ans, sess, nil
}

// sampleHop is computeHop's end for a plain step whose token the backend
// samples (smp).
func (s *Server) sampleHop(ctx context.Context, req *hopRequest, sess *session, buf []byte, smp *sched.SampleStep, t0 time.Time) (*hopAnswer, *session, *apiError) {
	w := sched.Work{Session: sess.kv, Pos: req.pos, Stage: &sched.Stage{First: req.start, Last: req.end, DType: req.dtype},
		Acts: buf[:req.nTokens*req.hidden*req.dtype.Size()], Sample: smp}
	res, err := s.submit(ctx, w)
	s.metrics.computeDone(time.Since(t0))
	if err != nil {
		sess.ends.lost(req.pos)
		return nil, nil, backendError(err)
	}
	sess.passRan(req.pass)
	if len(req.tokens) > 0 {
		sess.recordTokens(req.pos, req.tokens)
	}
	sess.ends.sampled(req.pos, req.nTokens, len(req.tokens) == req.nTokens)
	s.metrics.tokenGenerated()
	r := backendReply(res.Choice, req.params)
	ans := &hopAnswer{token: &r}
	s.pushReply(sess, req, ans)
	return ans, sess, nil
}

// backendError maps a native failure to a status: a full KV cache or
// allocation failure is 507, a rejected argument 400, the rest 500.
func backendError(err error) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	switch {
	case native.IsStatus(err, native.StatusCapacity), native.IsStatus(err, native.StatusOutOfMemory):
		return &apiError{Status: http.StatusInsufficientStorage, Type: "kv_cache_full", Message: err.Error()}
	case native.IsStatus(err, native.StatusInvalidArgument):
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_argument", Message: err.Error()}
	case native.IsStatus(err, native.StatusNonFinite):
		return errNonFiniteLogits()
	}
	return &apiError{Status: http.StatusInternalServerError, Type: "backend_error", Message: err.Error()}
}

// withMargin leaves the caller time to receive our answer: a downstream call
// ends 10% (at most 100 ms) before our own deadline.
func withMargin(d time.Time) time.Time {
	m := time.Until(d) / 10
	if m > 100*time.Millisecond {
		m = 100 * time.Millisecond
	}
	return d.Add(-m)
}
