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
// The pass's number tells apart a dropped pass in flight and the redo that
// replaces it at the same position and step; 0 for an unordered hop.
type replyKey struct {
	session   string
	pos, step int
	pass      uint32
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
	k := replyKey{d.Session, d.Position, d.Step, d.Pass}
	r.mu.Lock()
	w := r.m[k]
	r.mu.Unlock()
	if w == nil || w.verify != d.Verify {
		return "unknown", fmt.Errorf("no pass of session %q at position %d, step %d, pass %d waits for a direct reply", wire.Truncate(d.Session, 80), d.Position, d.Step, d.Pass)
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

// chainCall is one pass's chain send when the head also waits for its
// direct reply. Its state, under chainSet.mu, says who has the answer:
// the pass (waiting, then chainFirst or taken) or the send's goroutine
// (taken: it checks the chain answer against the direct one; abandoned:
// it only releases it).
type chainCall struct {
	pos    int
	state  chainState
	taken  []wire.TokenReply // the direct reply the head went on with
	first  chan chainResult  // the chain answer, when it came first; buffered
	cancel context.CancelFunc
}

type chainState int

const (
	chainWaiting   chainState = iota // the pass waits for either answer
	chainFirst                       // the chain answer came first; the pass takes it from first
	chainTaken                       // the pass went on with the direct reply
	chainAbandoned                   // the pass ended otherwise (dropped, canceled, failed)
)

type chainResult struct {
	res *hopAnswer
	ae  *apiError
}

// chainSet is a pipeline's chain sends that may outlive their passes (the
// passes in flight of one stream run sendDirect at once): each send checks
// its own answer, and the first failure or disagreement is the
// generation's.
type chainSet struct {
	mu     sync.Mutex
	wg     sync.WaitGroup
	ctx    context.Context // the sends' (closeChains ends it); nil until the first
	cancel context.CancelFunc
	err    *apiError     // the first chain answer that failed or disagreed
	failed chan struct{} // closed once err is set
}

// start is the context of a new chain send. A chain send outlives the pass
// that made it (a pass in flight is canceled once answered), not the
// generation: closeChains ends it, and sendHop gives each a deadline.
func (c *chainSet) start(ctx context.Context) (context.Context, context.CancelFunc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == nil {
		c.ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
		c.failed = make(chan struct{})
	}
	c.wg.Add(1)
	return context.WithCancel(c.ctx)
}

// fail records a chain failure; the first one stands.
func (c *chainSet) fail(ae *apiError) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = ae
		close(c.failed)
	}
}

// failure is (a copy of: each pass may amend its own) the chain failure
// recorded so far, and a channel closed once there is one.
func (c *chainSet) failure() (*apiError, <-chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		return nil, c.failed
	}
	ae := *c.err
	return &ae, c.failed
}

// settle moves c from waiting to to, answering the state it was in.
func (p *pipeline) settle(c *chainCall, to chainState) chainState {
	p.chains.mu.Lock()
	defer p.chains.mu.Unlock()
	if c.state != chainWaiting {
		return c.state
	}
	c.state = to
	return chainWaiting
}

// abandon ends c for a pass that ends without either answer: its chain
// send is canceled, or its answer, already here, released.
func (p *pipeline) abandon(c *chainCall) {
	if p.settle(c, chainAbandoned) == chainFirst {
		if r := <-c.first; r.res != nil {
			r.res.done()
		}
		return
	}
	c.cancel()
}

// sendDirect sends a pass down the route and answers its direct reply or
// its chain answer, whichever comes first; it owns hb (the chain send
// returns it to the pool). A chain answer that comes after the direct
// reply is checked as it arrives, and its failure fails the passes still
// waiting and the ones after (settleChains at the latest).
func (p *pipeline) sendDirect(ctx context.Context, call hopCall, hb *hostBuf) (*hopAnswer, *apiError) {
	s := p.s
	if ae, _ := p.chains.failure(); ae != nil {
		s.hosts.put(hb)
		return nil, ae
	}
	k := replyKey{p.id, call.pos, call.step, call.pass.Seq}
	w := &replyWaiter{key: p.direct, verify: call.verify, ch: make(chan []wire.TokenReply, 1)}
	if !s.replies.add(k, w) {
		s.metrics.directRefused("waiters_full")
		defer s.hosts.put(hb)
		return p.sendWaiting(ctx, call, hb.Bytes)
	}
	defer s.replies.remove(k, w)
	cctx, cancel := p.chains.start(ctx)
	c := &chainCall{pos: call.pos, first: make(chan chainResult, 1), cancel: cancel}
	go func() {
		defer p.chains.wg.Done()
		defer cancel()
		res, ae := p.sendWaiting(cctx, call, hb.Bytes)
		s.hosts.put(hb)
		r := chainResult{res, ae}
		switch p.settle(c, chainFirst) {
		case chainWaiting:
			c.first <- r
		case chainTaken:
			if ae := p.checkChain(c, r); ae != nil {
				p.chains.fail(ae)
			}
		case chainAbandoned:
			if res != nil {
				res.done()
			}
		}
	}()
	_, failed := p.chains.failure()
	select {
	case r := <-c.first:
		s.metrics.directReply("chain_first")
		return r.res, r.ae
	case toks := <-w.ch:
		tail := p.route[len(p.route)-1]
		ans := &hopAnswer{tokens: toks}
		if !call.verify {
			ans = &hopAnswer{token: &toks[0]}
		}
		if ae := s.checkAnswer(ans, tail); ae != nil {
			p.abandon(c)
			return nil, ae
		}
		p.chains.mu.Lock()
		st := c.state
		if st == chainWaiting {
			c.state, c.taken = chainTaken, toks
		}
		p.chains.mu.Unlock()
		if st == chainFirst {
			r := <-c.first // both came: the chain's, as if it had come first
			s.metrics.directReply("chain_first")
			return r.res, r.ae
		}
		s.metrics.directReply("direct")
		return ans, nil
	case <-failed:
		p.abandon(c)
		ae, _ := p.chains.failure()
		return nil, ae
	case <-ctx.Done():
		p.abandon(c)
		return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + ctx.Err().Error()}
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

// settleChains waits for the chain answers still due, each checked as it
// arrives; the generation is done only when the route agrees with what it
// streamed. Passes still in flight when the text ended are dropped first,
// so no send starts meanwhile.
func (p *pipeline) settleChains() *apiError {
	if p.spec != nil && p.spec.window != nil {
		p.spec.window.close()
	}
	p.chains.wg.Wait()
	ae, _ := p.chains.failure()
	return ae
}

// closeChains ends the chain sends still running (an error ended the
// generation) and waits for them: none outlives the pipeline.
func (p *pipeline) closeChains() {
	p.chains.mu.Lock()
	if p.chains.cancel != nil {
		p.chains.cancel()
	}
	p.chains.mu.Unlock()
	p.chains.wg.Wait()
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
	d := wire.DirectReply{Session: req.session, Position: req.pos, Step: req.step, Pass: req.pass.Seq, Verify: req.verify, Answer: aj}
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
