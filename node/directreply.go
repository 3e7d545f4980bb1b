package node

// Direct replies (docs/protocol.md, Direct replies): the route's last node
// POSTs each hop's answer straight to the head, N one-way delays a token
// for N nodes instead of 2(N-1), while the answer still travels back along
// the chain. The chain answer keeps failure detection and blame as they
// were (a middle node that loses its downstream still tells the head); the
// head goes on with whichever arrives first and checks the chain answer
// that arrives after a direct one against it.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"meshgpu/identity"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// Bounds of direct replies.
const (
	// maxReplyWaiters bounds the passes a head waits for direct replies to
	// at once; a pass beyond it waits for its chain answer only.
	maxReplyWaiters = 1024
	// maxReplyPushes bounds the direct replies a tail sends at once; one
	// beyond it is not sent (the chain answer still is).
	maxReplyPushes = 64
)

// replyTarget is where a session's tail sends direct replies: the head
// the verified ticket names and its address.
type replyTarget struct {
	head, endpoint, relay string
}

// replyTargetOf is the head's address in t when this node runs the route's
// last hop under it; nil when t names none.
func replyTargetOf(t *ticket.Ticket, last bool) *replyTarget {
	if !last || (t.HeadEndpoint == "" && t.HeadRelay == "") {
		return nil
	}
	return &replyTarget{head: t.Head, endpoint: t.HeadEndpoint, relay: t.HeadRelay}
}

// replyKey names the answer a head waits for: one pass of one session.
type replyKey struct {
	session   string
	pos, step int
}

// replyWaiter is a pass waiting for its direct reply, authenticated with
// the tail's session key.
type replyWaiter struct {
	key    []byte
	verify bool
	ch     chan []wire.TokenReply // one answer, buffered
}

// replyWaiters are the head's passes waiting for direct replies. A waiter
// takes one authentic answer and is gone: a replay, or an answer for a
// pass already answered, finds nothing.
type replyWaiters struct {
	mu sync.Mutex
	m  map[replyKey]*replyWaiter
}

func (r *replyWaiters) add(k replyKey, w *replyWaiter) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[replyKey]*replyWaiter{}
	}
	if _, dup := r.m[k]; dup || len(r.m) >= maxReplyWaiters {
		return false
	}
	r.m[k] = w
	return true
}

func (r *replyWaiters) remove(k replyKey, w *replyWaiter) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m[k] == w {
		delete(r.m, k)
	}
}

func (r *replyWaiters) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.m)
}

// deliver hands an authentic reply to its waiter; otherwise it answers why
// the reply is refused (a metric label).
func (r *replyWaiters) deliver(d *wire.DirectReply) (string, error) {
	k := replyKey{d.Session, d.Position, d.Step}
	r.mu.Lock()
	w := r.m[k]
	r.mu.Unlock()
	if w == nil || w.verify != d.Verify {
		return "unknown", fmt.Errorf("no pass of session %q at position %d, step %d waits for a direct reply", wire.Truncate(d.Session, 80), d.Position, d.Step)
	}
	if !hmac.Equal(d.MAC, wire.DirectReplyMAC(w.key, d)) {
		return "bad_mac", fmt.Errorf("the reply's MAC is not the tail's")
	}
	toks, err := d.Tokens()
	if err != nil {
		return "malformed", err
	}
	r.mu.Lock()
	taken := r.m[k] == w
	if taken {
		delete(r.m, k)
	}
	r.mu.Unlock()
	if !taken {
		return "unknown", fmt.Errorf("the pass was answered already")
	}
	w.ch <- toks
	return "", nil
}

// handleDirectReply serves POST /reply on a head.
func (s *Server) handleDirectReply(w http.ResponseWriter, r *http.Request) {
	var d wire.DirectReply
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, wire.MaxDirectReply))
	if err == nil {
		err = json.Unmarshal(body, &d)
	}
	if err != nil {
		s.metrics.directRefused("malformed")
		writeError(w, badRequest("direct reply: %v", err))
		return
	}
	if why, err := s.replies.deliver(&d); err != nil {
		s.metrics.directRefused(why)
		s.Logger.Debug("direct reply refused", "reason", why, "session", wire.Truncate(d.Session, 80), "remote", r.RemoteAddr, "error", err)
		status := http.StatusForbidden
		if why == "unknown" {
			status = http.StatusNotFound
		}
		writeError(w, &apiError{Status: status, Type: "direct_reply_refused", Message: err.Error()})
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// directKey is the tail's session key when the head drives g's route with
// direct replies (the ticket names this head's address), else nil.
func (s *Server) directKey(g *sessionGrant, route []wire.Hop) []byte {
	if s.NoDirectReplies || g == nil || len(g.ticket) == 0 || len(route) == 0 || len(g.keys) != len(route) {
		return nil
	}
	t, err := ticket.Parse(g.ticket)
	if err != nil || (t.HeadEndpoint == "" && t.HeadRelay == "") {
		return nil
	}
	return g.keys[len(g.keys)-1]
}

// chainCall is a pass's chain answer still to come after the head went on
// with its direct reply.
type chainCall struct {
	pos   int
	done  chan chainResult // one result, buffered
	taken []wire.TokenReply
}

type chainResult struct {
	res *hopAnswer
	ae  *apiError
}

// sendDirect sends a pass down the route and answers its direct reply or
// its chain answer, whichever comes first; it owns hb (the chain send
// returns it to the pool). A chain answer still due from an earlier pass
// is checked as it arrives.
func (p *pipeline) sendDirect(ctx context.Context, call hopCall, hb *hostBuf) (*hopAnswer, *apiError) {
	s := p.s
	k := replyKey{p.id, call.pos, call.step}
	w := &replyWaiter{key: p.direct, verify: call.verify, ch: make(chan []wire.TokenReply, 1)}
	if !s.replies.add(k, w) {
		s.metrics.directRefused("waiters_full")
		defer s.hosts.put(hb)
		return p.sendWaiting(ctx, call, hb.Bytes)
	}
	defer s.replies.remove(k, w)
	if p.chainCtx == nil {
		p.chainCtx, p.chainCancel = context.WithCancel(ctx)
	}
	c := &chainCall{pos: call.pos, done: make(chan chainResult, 1)}
	p.chains.Add(1)
	go func() {
		defer p.chains.Done()
		defer s.hosts.put(hb)
		res, ae := p.sendWaiting(p.chainCtx, call, hb.Bytes)
		c.done <- chainResult{res, ae}
	}()
	for {
		var older <-chan chainResult
		if len(p.pending) > 0 {
			older = p.pending[0].done
		}
		select {
		case r := <-older:
			done := p.pending[0]
			p.pending = p.pending[1:]
			if ae := p.checkChain(done, r); ae != nil {
				p.pending = append(p.pending, c) // settled when the pipeline closes
				return nil, ae
			}
		case r := <-c.done:
			s.metrics.directReply("chain_first")
			return r.res, r.ae
		case toks := <-w.ch:
			s.metrics.directReply("direct")
			tail := p.route[len(p.route)-1]
			ans := &hopAnswer{tokens: toks}
			if !call.verify {
				ans = &hopAnswer{token: &toks[0]}
			}
			if ae := s.checkAnswer(ans, tail); ae != nil {
				p.pending = append(p.pending, c)
				return nil, ae
			}
			c.taken = toks
			p.pending = append(p.pending, c)
			return ans, nil
		case <-ctx.Done():
			p.pending = append(p.pending, c)
			return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + ctx.Err().Error()}
		}
	}
}

// checkChain checks a chain answer that arrived after the head went on
// with the direct reply: a failure is the route's failure, as if the head
// had waited for it; an answer that differs from the direct one is a node
// on the route lying (the chain or the tail), blamed on the next hop.
func (p *pipeline) checkChain(c *chainCall, r chainResult) *apiError {
	if r.ae != nil {
		return r.ae
	}
	defer r.res.done()
	toks := r.res.tokens
	if r.res.token != nil {
		toks = []wire.TokenReply{*r.res.token}
	}
	same := len(toks) == len(c.taken)
	for i := 0; same && i < len(toks); i++ {
		same = toks[i].Token == c.taken[i].Token && toks[i].Logprob == c.taken[i].Logprob
	}
	if same {
		return nil
	}
	p.s.metrics.directRefused("chain_disagrees")
	return &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: p.route[0].Name(),
		Message: fmt.Sprintf("the chain answer at position %d differs from the direct reply of the last hop %s", c.pos, p.route[len(p.route)-1].Name())}
}

// settleChains waits for the chain answers still due and checks them; the
// generation is done only when the route agrees with what it streamed.
func (p *pipeline) settleChains() *apiError {
	for len(p.pending) > 0 {
		c := p.pending[0]
		p.pending = p.pending[1:]
		if ae := p.checkChain(c, <-c.done); ae != nil {
			return ae
		}
	}
	return nil
}

// closeChains ends the chain sends still running (an error ended the
// generation) and waits for them: none outlives the pipeline.
func (p *pipeline) closeChains() {
	if p.chainCancel != nil {
		p.chainCancel()
	}
	p.chains.Wait()
	for _, c := range p.pending {
		if r := <-c.done; r.res != nil {
			r.res.done()
		}
	}
	p.pending = nil
}

// pushReply sends a hop's answer straight to the session's head, when the
// ticket the session was claimed under names the head's address. It does
// not wait: the chain answer goes back at once, and a reply that cannot be
// sent is only slower.
func (s *Server) pushReply(sess *session, req *hopRequest, ans *hopAnswer) {
	v := sess.verified.Load()
	key := sess.key.Load()
	if s.NoDirectReplies || v == nil || v.replyTo == nil || key == nil {
		return
	}
	to := v.replyTo
	if to.endpoint == "" && s.Relay == nil {
		return
	}
	var answer any = ans.token
	if req.verify {
		answer = wire.VerifyReply{Tokens: ans.tokens}
	}
	aj, err := json.Marshal(answer)
	if err != nil {
		return
	}
	d := wire.DirectReply{Session: req.session, Position: req.pos, Step: req.step, Verify: req.verify, Answer: aj}
	d.MAC = wire.DirectReplyMAC(*key, &d)
	body, err := json.Marshal(d)
	if err != nil {
		return
	}
	select {
	case s.replyPushes <- struct{}{}:
	default:
		s.metrics.directSent("skipped")
		return
	}
	deadline := time.Now().Add(s.HopTimeout)
	if !req.deadline.IsZero() && req.deadline.Before(deadline) {
		deadline = req.deadline
	}
	s.background(func() {
		defer func() { <-s.replyPushes }()
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		defer cancel()
		if err := s.sendReply(ctx, to, body); err != nil {
			s.metrics.directSent("failed")
			s.Logger.Debug("direct reply not delivered; the chain answer carries it", "head", to.head, "session", req.session, "error", err)
			return
		}
		s.metrics.directSent("ok")
	})
}

// sendReply POSTs a direct reply to the head's endpoint (pinned to its
// peer id over https), else through its relay.
func (s *Server) sendReply(ctx context.Context, to *replyTarget, body []byte) error {
	base := strings.TrimRight(to.endpoint, "/")
	useRelay := base == ""
	if useRelay {
		base = relayOnlyBase(wire.Hop{PeerID: to.head})
	}
	req, err := http.NewRequestWithContext(identity.WithPeerID(ctx, to.head), http.MethodPost, base+wire.DirectReplyPath, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	var resp *http.Response
	if useRelay {
		resp, err = s.Relay.Do(ctx, to.relay, req)
	} else {
		resp, err = s.client.Do(req)
	}
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("the head answered %s", resp.Status)
	}
	return nil
}
