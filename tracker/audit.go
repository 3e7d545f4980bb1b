package tracker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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

	"github.com/prometheus/client_golang/prometheus"

	"meshgpu/openai"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// Verified compute (issues 14 and 26, docs/security.md "Audits"):
// re-execution. Every proxied generation has a seed and asks its head for
// logprobs with their top alternatives, so the tracker holds, for each
// position, the token the route chose and its logprob under the route's
// model. An audit takes one hop of that route (the audited layer range) and
// a referee route that differs only there, and sends the referee route the
// same request again (same seed, same limits and shape, so the referee
// cannot tell it from a client's session): the deterministic sampler draws
// what an honest route draws. Where the referee's token differs from the
// route's, the audit judges whether an honest route could have chosen it
// (a tie within the tolerance, or a draw on a boundary the noise can move)
// and, if so, continues the referee after the route's token
// (meshgpu.continue_ids, like a failover replay); if not, the route chose a
// token it should not have. The audited node is never asked anything.

// Audit statuses beyond AuditPassed and AuditFailed.
const (
	AuditProbation = "probation" // new: routed only for its audit
	AuditDisputed  = "disputed"  // disagreed with a peer, no third opinion yet
	AuditUnaudited = "unaudited" // no other replica to compare with: routed, audited when one comes
	AuditTrusted   = "trusted"   // the operator's --audit-trusted peer
)

// Defaults of the audit flags.
const (
	DefaultAuditRate      = 0.03
	DefaultAuditTolerance = 0.5 // nats; docs/security.md has the calibration
	// DefaultAuditTieTolerance is how far below the referee's argmax a
	// route's token may be at temperature 0: honest routes' logprobs
	// differ by at most 0.026 nats across dtypes and thread counts
	// (docs/security.md), so 0.1 leaves room without buying a liar every
	// near-best token.
	DefaultAuditTieTolerance = 0.1
	DefaultAuditPositions    = 4
	// auditDrawDrift bounds the probability mass that honest noise can
	// move a sampled draw across: the draw walks the tokens in id order,
	// so noise in every logit below the draw shifts where it lands (0.026
	// nats at temperature 0.8 moves the cumulative sum by up to about 7%).
	auditDrawDrift          = 0.05
	DefaultAuditBan         = 10 * time.Minute
	maxAuditBan             = 7 * 24 * time.Hour
	auditTopLogprobs        = wire.MaxTopLogprobs
	auditQueue              = 32 // pending sampled audits; more are dropped (low priority)
	auditRecentPrompts      = 16 // real requests kept for probation audits
	auditMaxDisputes        = 64
	auditProbationTokens    = 24 // a built-in prompt's session
	auditProbationMaxTokens = 64 // a recent real prompt's, at most
)

// AuditConfig configures audits; the zero value turns them off.
type AuditConfig struct {
	// Rate is the fraction of proxied generations audited (0: none).
	Rate float64
	// Tolerance is the largest |logprob difference| (nats) of one token
	// that two honest routes may show.
	Tolerance float64
	// TieTolerance is how far (nats) below the referee's argmax a
	// route's token may be at temperature 0 (default
	// DefaultAuditTieTolerance).
	TieTolerance float64
	// Positions is how many ties (positions where the referee chose
	// another token an honest route could have chosen) one audit follows.
	Positions int
	// Probation makes a new node wait, out of real traffic, until one
	// audit of a probation session through it passes.
	Probation bool
	// Trusted peers are referees whose answer is believed alone.
	Trusted []string
	// Ban is how long the first failed audit keeps a node out; each
	// further failure doubles it.
	Ban time.Duration
	// Interval is how often new nodes and open disputes are looked at.
	Interval time.Duration
	// Timeout bounds one audit.
	Timeout time.Duration
	// Concurrency is how many audits run at once (default 1).
	Concurrency int
	// Yield is how long an audit's request waits at most while real
	// generations of this tracker are running on its route's nodes
	// (default 2s): audits come after real traffic without starving.
	Yield time.Duration
}

func (c AuditConfig) enabled() bool { return c.Rate > 0 || c.Probation }

// auditToken is one generated position as the route reported it.
type auditToken struct {
	id      int
	text    string  // the token as the head's logprobs name it
	content string  // the text the head streamed with it (what the client reads)
	eos     bool    // the end-of-text step (meshgpu_end): id is the end token
	logprob float64 // NaN: not reported
	top     []wire.Candidate
}

// auditCase is one generation to check.
type auditCase struct {
	model  string
	path   string
	chat   bool
	req    map[string]any // the client's request fields (meshgpu as the client sent it)
	max    int            // the client's limit (-1: none) and its field
	maxKey string
	toks   []auditToken // ending with the end-of-text step when the route drew one
	tail   string       // text streamed after the last id (held back for a stop string)
	finish string       // the route's finish_reason ("": not known)
	start  int          // toks[start:] were produced on rt
	rt     route.Route
	target string // the peer to audit ("": any auditable hop)
	digest string // of the inputs: path, request and token ids
}

// auditor runs the audits of one Server.
type auditor struct {
	s       *Server
	cfg     AuditConfig
	trusted map[string]bool
	queue   chan *auditCase

	// statusMu serialises status changes: each re-reads the current status
	// and derives the next from it (update), so a slow audit never writes
	// back a status read minutes before.
	statusMu sync.Mutex
	mu       sync.Mutex
	rng      *rand.Rand
	recent   []*auditCase // recent real requests (probation prompts)
	// disputes holds the case each open dispute was found on, by pair; the
	// open disputes themselves are the stored statuses' With (retryDisputes),
	// so a dispute whose case was dropped (bounded) or found by another
	// tracker is still retried.
	disputes map[[2]string]*dispute
	// disputed mirrors the stored disputed statuses (peer -> With), kept
	// by update and every scan: the proxy's hot path reads only this.
	disputed map[string]string
	retrying chan struct{}        // bounds the dispute retries running at once
	running  map[string]bool      // probation audits in flight
	wg       sync.WaitGroup       // the probation goroutines (RunAudits waits)
	failed   map[string]time.Time // peers failed by this tracker (until when), for running sessions
	// disputeTraffic counts requests through disputed nodes (dispute.go).
	disputeTraffic map[string]*disputeCounts

	rate    atomic.Uint64 // float64 bits of the sampled rate (SetAuditRate)
	version atomic.Uint64 // bumped on each failure: running sessions look again

	audits   *prometheus.CounterVec
	queued   prometheus.Counter
	failures *prometheus.CounterVec
	diffs    prometheus.Histogram
	// disputeSessions counts attempts run on both disputed replicas.
	disputeSessions *prometheus.CounterVec
}

// dispute is a disagreement waiting for a third opinion.
type dispute struct {
	c        *auditCase // nil: not known here (a fresh session through a is audited)
	hop      int
	a, b     string // audited and referee peers
	evidence string
	at       time.Time
}

func disputeKey(a, b string) [2]string {
	if b < a {
		a, b = b, a
	}
	return [2]string{a, b}
}

func newAuditor(s *Server, cfg AuditConfig) *auditor {
	if cfg.Tolerance <= 0 {
		cfg.Tolerance = DefaultAuditTolerance
	}
	if cfg.TieTolerance <= 0 {
		cfg.TieTolerance = DefaultAuditTieTolerance
	}
	if cfg.Positions <= 0 {
		cfg.Positions = DefaultAuditPositions
	}
	if cfg.Ban <= 0 {
		cfg.Ban = DefaultAuditBan
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Minute
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 1
	}
	if cfg.Yield <= 0 {
		cfg.Yield = 2 * time.Second
	}
	a := &auditor{s: s, cfg: cfg, trusted: map[string]bool{}, queue: make(chan *auditCase, auditQueue),
		rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0x5eed)), running: map[string]bool{}, failed: map[string]time.Time{},
		disputeTraffic: map[string]*disputeCounts{}, disputes: map[[2]string]*dispute{}, disputed: map[string]string{},
		retrying: make(chan struct{}, cfg.Concurrency)}
	a.rate.Store(math.Float64bits(cfg.Rate))
	for _, id := range cfg.Trusted {
		a.trusted[id] = true
	}
	a.audits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshgpu_tracker_audits_total", Help: "Audits of nodes' work by result (passed, failed, disputed, inconclusive, skipped: nothing to compare with; dropped: the queue was full).",
	}, []string{"result"})
	a.queued = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshgpu_tracker_audits_queued_total", Help: "Sampled audits queued (each ends as one audits_total result other than dropped).",
	})
	a.failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshgpu_tracker_audit_failures_total", Help: "Failed audits by node.",
	}, []string{"peer"})
	a.diffs = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "meshgpu_tracker_audit_logprob_diff", Help: "Largest |logprob difference| of an audit (nats).",
		Buckets: prometheus.ExponentialBuckets(1e-4, 4, 10),
	})
	a.disputeSessions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshgpu_tracker_dispute_attempts_total", Help: "Attempts whose route ran through a disputed node, run on both replicas: served (they agreed) or refused (503 audit_dispute).",
	}, []string{"result"})
	return a
}

func (a *auditor) collectors() []prometheus.Collector {
	return []prometheus.Collector{a.audits, a.queued, a.failures, a.diffs, a.disputeSessions}
}

// RunAudits runs the server's audits until ctx ends: the sampled audits
// queued by the proxy, the probation audits of new nodes and the third
// opinions of open disputes. Without it nothing is audited (sampled audits
// are dropped once the queue is full) and probation nodes wait.
func (s *Server) RunAudits(ctx context.Context) {
	a := s.audit
	if a == nil || !a.cfg.enabled() {
		<-ctx.Done()
		return
	}
	var wg sync.WaitGroup
	for range a.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-ctx.Done():
					return
				case c := <-a.queue:
					a.check(ctx, c)
				}
			}
		}()
	}
	tick := time.NewTicker(a.cfg.Interval)
	defer tick.Stop()
	for {
		a.scan(ctx)
		select {
		case <-ctx.Done():
			wg.Wait()
			a.wg.Wait()
			return
		case <-tick.C:
		}
	}
}

// offer is called by the proxy when a generation finished; it keeps the
// request for probation prompts and queues a sampled audit.
func (a *auditor) offer(g *generation, rt route.Route) {
	if !a.on() || len(g.toks) == 0 {
		return
	}
	finish, _ := g.finish.(string)
	c := &auditCase{model: g.model, path: g.path, chat: g.chat, req: g.req, max: g.max, maxKey: g.maxKey, toks: slices.Clone(g.toks),
		tail: g.tail.String(), finish: finish, start: g.startIDs, rt: rt}
	if g.end != nil {
		c.toks = append(c.toks, *g.end)
	}
	a.mu.Lock()
	a.recent = append(a.recent, c)
	if len(a.recent) > auditRecentPrompts {
		a.recent = a.recent[1:]
	}
	rate := math.Float64frombits(a.rate.Load())
	sampled := rate > 0 && a.rng.Float64() < rate
	a.mu.Unlock()
	if !sampled {
		return
	}
	select {
	case a.queue <- c:
		a.queued.Inc()
	default:
		a.audits.WithLabelValues("dropped").Inc() // busy: audits come after real traffic
	}
}

// on says whether generations carry what audits need (logprobs).
func (a *auditor) on() bool {
	return a != nil && (a.cfg.Probation || math.Float64frombits(a.rate.Load()) > 0)
}

// SetAuditRate changes the sampled audit rate of a running server whose
// audits are configured (Config.Audit); 0 stops sampled audits and, without
// probation, the logprobs they need (the overhead benchmark compares both).
func (s *Server) SetAuditRate(rate float64) {
	if s.audit != nil {
		s.audit.rate.Store(math.Float64bits(rate))
	}
}

// failedHop returns a hop of rt that failed an audit since the caller's
// version (a running session then moves to another replica), and the
// current version.
func (a *auditor) failedHop(rt route.Route, since uint64) (string, uint64) {
	if a == nil {
		return "", 0
	}
	v := a.version.Load()
	if v == since {
		return "", v
	}
	now := a.s.cfg.Clock()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, h := range rt.Hops {
		if until, ok := a.failed[h.PeerID]; ok && now.Before(until) {
			return h.PeerID, v
		}
	}
	return "", v
}

// auditExcluded returns the nodes whose audit status keeps them out of
// real traffic: failed ones until their exclusion ends; and, with
// probation on, new ones (not looked at yet, on probation, or disputed
// while on probation) when a node of the same variant that may serve holds
// their layers too (a new node alone on its layers in its variant has no
// one to be compared with, and serves; a banned node does not count as
// one). Trusted peers are never excluded.
func (g *Registry) auditExcluded(nodes []route.Node, statuses map[string]NodeStatus, banned map[string]time.Time, now time.Time) map[string]bool {
	out := map[string]bool{}
	var fresh []route.Node
	for _, n := range nodes {
		st, has := statuses[n.PeerID]
		switch {
		case g.trusted[n.PeerID]:
		case st.Audit == AuditFailed && (st.Until.IsZero() || now.Before(st.Until)):
			out[n.PeerID] = true
		case g.probation && (!has || st.Audit == "" || st.Audit == AuditProbation || st.Audit == AuditFailed ||
			(st.Audit == AuditDisputed && st.Probation)):
			fresh = append(fresh, n)
		}
	}
	isFresh := make(map[string]bool, len(fresh))
	for _, n := range fresh {
		isFresh[n.PeerID] = true
	}
	for _, n := range fresh {
		for _, m := range nodes {
			_, ban := banned[m.PeerID]
			if m.PeerID != n.PeerID && m.Variant.Same(n.Variant) && !out[m.PeerID] && !isFresh[m.PeerID] && !ban && m.First <= n.First && m.Last >= n.Last {
				out[n.PeerID] = true
				break
			}
		}
	}
	return out
}

// scan classifies new nodes, starts their probation audits and retries
// disputes.
func (a *auditor) scan(ctx context.Context) {
	nodes, statuses, err := a.view(ctx)
	if err != nil {
		return
	}
	now := a.s.cfg.Clock()
	for _, n := range nodes {
		st, has := statuses[n.PeerID]
		switch {
		case a.trusted[n.PeerID]:
			if st.Audit != AuditTrusted {
				a.update(ctx, n.PeerID, func(cur NodeStatus) (NodeStatus, bool) {
					return NodeStatus{Audit: AuditTrusted, Failures: cur.Failures, Passes: cur.Passes}, cur.Audit != AuditTrusted
				})
			}
			continue
		case !has || st.Audit == "" || (st.Audit == AuditFailed && !st.Until.IsZero() && !now.Before(st.Until)):
			if !a.cfg.Probation {
				continue
			}
			// new, or its exclusion is over: probation again
			if !a.update(ctx, n.PeerID, func(cur NodeStatus) (NodeStatus, bool) {
				st = NodeStatus{Audit: AuditProbation, Failures: cur.Failures, Passes: cur.Passes, Probation: true}
				return st, cur.Audit == "" || (cur.Audit == AuditFailed && !now.Before(cur.Until))
			}) {
				continue
			}
		}
		if st.Audit == AuditProbation || (st.Audit == AuditUnaudited && a.cfg.Probation) ||
			(st.Audit == AuditDisputed && st.Probation && st.With == "") {
			a.startProbation(ctx, n, st, nodes, statuses)
		}
	}
	a.mu.Lock()
	clear(a.disputed)
	for id, st := range statuses {
		if st.Audit == AuditDisputed && st.With != "" {
			a.disputed[id] = st.With
		}
	}
	a.mu.Unlock()
	a.retryDisputes(ctx, nodes, statuses)
}

// noteDisputed keeps the in-memory disputed set in step with a status
// this tracker wrote.
func (a *auditor) noteDisputed(st NodeStatus) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if st.Audit == AuditDisputed && st.With != "" {
		a.disputed[st.PeerID] = st.With
	} else {
		delete(a.disputed, st.PeerID)
	}
}

// view reads the live nodes and their statuses.
func (a *auditor) view(ctx context.Context) ([]NodeRecord, map[string]NodeStatus, error) {
	nodes, err := a.s.reg.Nodes(ctx)
	if err != nil {
		return nil, nil, err
	}
	statuses, err := a.s.reg.store.Statuses(ctx)
	// A node giving way to its variant's layer count (shape.go) is not
	// routed, so neither audited nor a referee.
	return a.s.reg.shaped(nodes, func() map[string]NodeStatus { return statuses }), statuses, err
}

// startProbation runs a probation session through n and audits it, in
// its own goroutine (owned by RunAudits' ctx, one per node at a time).
func (a *auditor) startProbation(ctx context.Context, n NodeRecord, st NodeStatus, nodes []NodeRecord, statuses map[string]NodeStatus) {
	a.mu.Lock()
	if a.running[n.PeerID] {
		a.mu.Unlock()
		return
	}
	now := a.s.cfg.Clock()
	if _, ok := a.referee(n.PeerID, n.Variant, n.Layers[0], n.Layers[1], nodes, statuses, now, nil); !ok {
		a.mu.Unlock()
		// Only a node alone on its layers serves unaudited: one whose
		// replicas cannot judge now (disputed) waits, out of traffic, for
		// them (else a newcomer joining a disputed range served alone).
		if st.Audit != AuditUnaudited && !a.replicated(n, nodes, statuses, now) {
			// Nothing to compare with: it serves, unaudited, until a replica comes.
			a.update(ctx, n.PeerID, func(cur NodeStatus) (NodeStatus, bool) {
				return NodeStatus{Audit: AuditUnaudited, Failures: cur.Failures, Passes: cur.Passes,
					Detail: "no other replica of its layers and variant to compare with"}, cur.Audit == st.Audit
			})
		}
		return
	}
	a.running[n.PeerID] = true
	a.wg.Add(1)
	var prompt *auditCase
	if len(a.recent) > 0 { // once traffic exists, no built-in prompt gives a probation away
		prompt = a.recent[a.rng.IntN(len(a.recent))]
	}
	a.mu.Unlock()
	go func() {
		defer a.wg.Done()
		defer func() {
			a.mu.Lock()
			delete(a.running, n.PeerID)
			a.mu.Unlock()
		}()
		c, err := a.probationSession(ctx, n, nodes, statuses, prompt)
		if err != nil {
			a.s.log.Debug("audit: probation session did not run", "peer", n.PeerID, "err", err)
			return
		}
		a.check(ctx, c)
	}()
}

// replicated says whether another node not excluded by a failure holds
// n's layers in n's variant.
func (a *auditor) replicated(n NodeRecord, nodes []NodeRecord, statuses map[string]NodeStatus, now time.Time) bool {
	for _, r := range nodes {
		st := statuses[r.PeerID]
		if r.PeerID != n.PeerID && r.Model == n.Model && r.Variant.Same(n.Variant) && r.Layers[0] <= n.Layers[0] && r.Layers[1] >= n.Layers[1] &&
			!(st.Audit == AuditFailed && now.Before(st.Until)) {
			return true
		}
	}
	return false
}

// Plausible prompts for a probation audit before any real traffic came
// (afterwards probation sessions take a recent request's prompt).
var probationPrompts = []string{
	"Write a Go function that reverses a slice of strings.",
	"How do I read a file line by line in Go?",
	"Explain what a goroutine leak is and how to avoid one.",
	"Write a function that checks whether a string is a palindrome.",
	"What is the difference between a slice and an array in Go?",
	"Write a small HTTP server in Go that answers hello.",
}

// probationSession runs one generation through a route holding n, as real
// traffic would (the same request shape the proxy sends), and returns it
// as an audit case targeting n.
func (a *auditor) probationSession(ctx context.Context, n NodeRecord, nodes []NodeRecord, statuses map[string]NodeStatus, like *auditCase) (*auditCase, error) {
	now := a.s.cfg.Clock()
	bans, err := a.s.reg.store.Bans(ctx, now)
	if err != nil {
		return nil, err
	}
	var rn []route.Node
	layers := 0
	for _, r := range nodes {
		if r.Model == n.Model {
			layers = r.NumLayers
			rn = append(rn, r.routeNode())
		}
	}
	// The other layers go through nodes of n's variant that serve real
	// traffic; n's layers only through n.
	excluded := a.s.reg.auditExcluded(rn, statuses, bans, now)
	rt, err := route.Find(rn, layers, route.Options{Seed: a.s.seq.Add(1), Variant: &n.Variant.Fingerprint, Exclude: func(id string) bool {
		for _, r := range nodes {
			if r.PeerID == id && id != n.PeerID && r.Layers[0] <= n.Layers[1] && r.Layers[1] >= n.Layers[0] {
				return true
			}
		}
		_, banned := bans[id]
		return id != n.PeerID && (banned || excluded[id])
	}}, a.s.cfg.Route)
	if err != nil {
		return nil, err
	}
	c := &auditCase{model: n.Model, path: "/v1/chat/completions", chat: true, target: n.PeerID, rt: rt}
	if like != nil && like.model == n.Model {
		c.path, c.chat = like.path, like.chat
		c.req = make(map[string]any, len(like.req))
		for k, v := range like.req {
			c.req[k] = v
		}
		// bounded like any short request (a chat without a limit runs to the context)
		delete(c.req, "max_completion_tokens")
		if n, ok := jsonInt(c.req["max_tokens"]); !ok || n > auditProbationMaxTokens {
			c.req["max_tokens"] = auditProbationMaxTokens
		}
	} else {
		msg := probationPrompts[a.s.seq.Add(1)%uint64(len(probationPrompts))]
		c.req = map[string]any{"messages": []map[string]string{{"role": "user", "content": msg}},
			"max_tokens": auditProbationTokens, "temperature": 0}
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	c.max, c.maxKey = -1, "max_tokens"
	if n, ok := jsonInt(c.req["max_tokens"]); ok {
		c.max = n
	}
	// A fresh seed, as the proxy gives every generation without one: the
	// recent request's own would make this session its replay.
	c.req["seed"] = rand.Int64()
	var toks []auditToken
	end, err := a.generate(ctx, c, rt, 0, func(t auditToken) bool { toks = append(toks, t); return true })
	if err != nil {
		return nil, err
	}
	if len(toks) == 0 {
		return nil, errors.New("the probation session produced no token")
	}
	if end.eos != nil {
		toks = append(toks, *end.eos)
	}
	c.toks, c.tail, c.finish = toks, end.tail, end.finish
	return c, nil
}

// referee picks a node other than the excluded ones that holds layers
// first..last of the audited node's model in variant (the weights the
// audited work was done with: another variant's numbers differ by design)
// and may judge: trusted first, then one that passed, then any not failed,
// disputed or on probation, then one on probation.
func (a *auditor) referee(audited string, variant wire.Variant, first, last int, nodes []NodeRecord, statuses map[string]NodeStatus, now time.Time, skip map[string]bool) (NodeRecord, bool) {
	var model string
	for _, r := range nodes {
		if r.PeerID == audited {
			model = r.Model
		}
	}
	best, rank := NodeRecord{}, 0
	for _, r := range nodes {
		if r.PeerID == audited || skip[r.PeerID] || r.Model != model || !r.Variant.Same(variant) || r.Layers[0] > first || r.Layers[1] < last {
			continue
		}
		st, has := statuses[r.PeerID]
		k := 1
		switch {
		case a.trusted[r.PeerID]:
			k = 4
		case st.Audit == AuditPassed:
			k = 3
		case st.Audit == AuditFailed || st.Audit == AuditDisputed:
			// A disputed node judges no one: a liar in a dispute would
			// referee the newcomer that could break its tie (and dispute
			// it too), or its own disputant.
			continue
		case st.Audit == AuditProbation || !has:
			k = 1
		default:
			k = 2
		}
		if k > rank {
			best, rank = r, k
		}
	}
	return best, rank > 0
}

// check audits a case: pick the hop, a referee route, replay.
func (a *auditor) check(ctx context.Context, c *auditCase) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	if c.digest == "" {
		c.digest = c.inputsDigest()
	}
	nodes, statuses, err := a.view(ctx)
	if err != nil {
		return
	}
	now := a.s.cfg.Clock()
	var cands []int
	for i, h := range c.rt.Hops {
		if (c.target == "" && !a.trusted[h.PeerID]) || h.PeerID == c.target {
			if _, ok := a.referee(h.PeerID, c.rt.Variant, h.StartLayer, h.EndLayer, nodes, statuses, now, nil); ok {
				cands = append(cands, i)
			}
		}
	}
	if len(cands) == 0 {
		a.audits.WithLabelValues("skipped").Inc()
		return
	}
	a.mu.Lock()
	hop := cands[a.rng.IntN(len(cands))]
	a.mu.Unlock()
	audited := c.rt.Hops[hop]
	ref, _ := a.referee(audited.PeerID, c.rt.Variant, audited.StartLayer, audited.EndLayer, nodes, statuses, now, nil)
	v, err := a.replay(ctx, c, hop, ref)
	if err != nil {
		a.audits.WithLabelValues("inconclusive").Inc()
		a.s.log.Info("audit: referee route failed", "peer", audited.PeerID, "referee", ref.PeerID, "err", err)
		return
	}
	if v.n == 0 {
		a.audits.WithLabelValues("inconclusive").Inc()
		return
	}
	a.diffs.Observe(v.diff)
	evidence := fmt.Sprintf("inputs %s: %s, between %s and referee %s", c.digest, v.detail, audited.PeerID, ref.PeerID)
	if v.ok {
		a.audits.WithLabelValues("passed").Inc()
		a.pass(ctx, audited.PeerID, ref.PeerID, statuses[ref.PeerID], false, evidence)
		return
	}
	if a.trusted[ref.PeerID] {
		a.fail(ctx, audited.PeerID, evidence)
		return
	}
	a.thirdOpinion(ctx, &dispute{c: c, hop: hop, a: audited.PeerID, b: ref.PeerID, evidence: evidence})
}

// verdict is what a replay found.
type verdict struct {
	ok      bool
	unknown bool    // nothing to judge by (the referee named no alternatives, or filters move the draw): neither pass nor fail
	diff    float64 // largest |logprob difference| where both chose one token
	n       int     // positions compared
	ties    int     // positions where the referee chose another token an honest route could have chosen
	detail  string
}

// auditEnd is how a referee's stream ended.
type auditEnd struct {
	eos    *auditToken // the end-of-text step (meshgpu_end)
	tail   string      // text after the last id
	finish string
	tools  bool // tool calls came without ids: nothing to compare by token
}

// replay sends c's request again over c's route with hop replaced by ref
// and checks every token the route chose from c.start on, and its ending:
// where the referee's token is the same, the text streamed with it and the
// route's logprob claim; where it is not (an end of text included),
// whether an honest route could have chosen the route's token (choiceOK):
// if so the referee goes on after the route's token, at most
// Config.Positions times; if not the audit fails. Where both ran to the
// end, the held-back text and the finish reason must match too.
func (a *auditor) replay(ctx context.Context, c *auditCase, hop int, ref NodeRecord) (verdict, error) {
	rt := route.Route{Hops: slices.Clone(c.rt.Hops), Variant: c.rt.Variant}
	h := rt.Hops[hop]
	rt.Hops[hop] = wire.Hop{PeerID: ref.PeerID, Endpoint: ref.Endpoint, RelayAddr: ref.RelayAddr, StartLayer: h.StartLayer, EndLayer: h.EndLayer}
	dec := c.decoding()
	v := verdict{ok: true}
	for from := c.start; from < len(c.toks); {
		k, diverged, bad, unknown := from, false, "", false
		judge := func(want, r auditToken) {
			diverged = true
			switch verdict, why := a.choiceOK(want, r, dec); verdict {
			case choiceBad:
				bad = fmt.Sprintf("position %d (seed %s): the route chose token %d %q (end of text: %v), the referee %d (end of text: %v): %s",
					k, c.seed(), want.id, want.text, want.eos, r.id, r.eos, why)
			case choiceUnknown:
				unknown = true
				v.detail = fmt.Sprintf("position %d: %s", k, why)
			}
		}
		refTop := false
		end, err := a.generate(ctx, c, rt, from, func(r auditToken) bool {
			v.n++
			refTop = refTop || len(r.top) > 0
			if k >= len(c.toks) {
				if len(r.top) == 0 {
					unknown, v.detail = true, "the route ended where the referee went on, and no alternatives were asked (echo)"
					return false
				}
				bad = fmt.Sprintf("the route ended at position %d (finish %q) where the referee went on with token %d", k, c.finish, r.id)
				return false
			}
			want := c.toks[k]
			if r.id != want.id || want.eos {
				judge(want, r)
				return false
			}
			if r.content != want.content {
				bad = fmt.Sprintf("position %d: token %d came with the text %q, the referee's with %q", k, r.id, want.content, r.content)
				return false
			}
			if !math.IsNaN(want.logprob) && !math.IsNaN(r.logprob) {
				v.diff = max(v.diff, math.Abs(want.logprob-r.logprob))
			}
			k++
			return true // on to the end: the ending is checked too
		})
		if err != nil {
			return verdict{}, err
		}
		if !diverged && bad == "" && k < len(c.toks) {
			// The referee ended where the route went on, or ended the text too.
			switch want := c.toks[k]; {
			case end.eos == nil && !refTop:
				unknown, v.detail = true, "the referee ended where the route went on, and no alternatives were asked (echo)"
			case end.eos == nil:
				bad = fmt.Sprintf("the referee ended at position %d (finish %q) without an end-of-text step, where the route went on with token %d", k, end.finish, want.id)
			case want.eos && want.id == end.eos.id:
				k++
			default:
				v.n++
				judge(want, *end.eos)
			}
		}
		if bad != "" {
			v.ok, v.detail = false, bad
			return v, nil
		}
		if unknown {
			v.unknown = true
			return v, nil
		}
		if !diverged {
			if end.tools {
				v.unknown, v.detail = true, "tool calls came without token ids"
				return v, nil
			}
			if c.finish != "" && (end.finish != c.finish || end.tail != c.tail) {
				v.ok = false
				v.detail = fmt.Sprintf("the route ended with %q and finish %q, the referee with %q and finish %q", c.tail, c.finish, end.tail, end.finish)
				return v, nil
			}
			break
		}
		v.ties++
		if v.ties > a.cfg.Positions {
			v.ok, v.detail = false, fmt.Sprintf("the referee chose other tokens at %d positions (at most %d ties), the last at %d", v.ties, a.cfg.Positions, k)
			return v, nil
		}
		from = k + 1
	}
	v.detail = fmt.Sprintf("%d positions (seed %s), %d ties, max |logprob diff| %.4g nats (tolerance %.4g)", v.n, c.seed(), v.ties, v.diff, a.cfg.Tolerance)
	if v.diff > a.cfg.Tolerance {
		v.ok = false
	}
	return v, nil
}

// decoding is how a case's tokens were chosen, as far as choiceOK cares.
type decoding struct {
	greedy bool
	// filtered: top_p, top_k, min_p, constrained decoding or logit bias
	// shape the kept set, whose boundary noise can move.
	filtered bool
	topK     int
}

func (c *auditCase) decoding() decoding {
	d := decoding{greedy: c.temperature() == 0}
	if f, ok := c.number("top_p"); ok && f < 1 {
		d.filtered = true
	}
	if f, ok := c.number("min_p"); ok && f > 0 {
		d.filtered = true
	}
	if f, ok := c.number("top_k"); ok && f > 0 {
		d.filtered, d.topK = true, int(f)
	}
	for _, k := range []string{"response_format", "logit_bias", "tools"} {
		if raw, ok := c.req[k].(json.RawMessage); ok && string(raw) != "null" {
			d.filtered = true
		}
	}
	return d
}

// Results of choiceOK.
const (
	choiceBad     = iota // an honest route would not have chosen it
	choiceTie            // it could have: the audit follows the route's token
	choiceUnknown        // nothing to judge by
)

// choiceOK judges whether an honest route could have chosen want where the
// referee, with the same inputs, seed and step, chose ref (either may be
// an end of text). With greedy decoding want must be the referee's argmax
// up to TieTolerance. With sampling the draw walks the tokens in id order
// and noise moves where it lands by a little probability mass, so the
// listed tokens between the two in id order may weigh at most
// auditDrawDrift together. Their mass is what bounds the draw, not how
// they rank against the two: when both are rare, a token likelier than
// either can still weigh little (honest bf16/f32 hops at temperature 0.8
// crossed one of logprob -6.07, e2e TestAuditNoFalseAlarms).
// Unlisted tokens between them, or an unlisted want, bound nothing: the
// top alternatives do not say how little they weigh, and honest bf16/f32
// noise crossed 23 of them (e2e TestAuditNoFalseAlarms); Positions caps
// such ties per audit. With filters the kept set's boundary moves too, so
// a listed want is a tie and an unlisted one fails only when top_k keeps
// no more than the list. Either way the route's claim about want must
// match the referee's figure (or stay below its least alternative, within
// Tolerance).
func (a *auditor) choiceOK(want, ref auditToken, d decoding) (int, string) {
	if len(ref.top) == 0 {
		return choiceUnknown, "the referee named no alternatives"
	}
	listed := make(map[int]float64, len(ref.top))
	least, best := math.Inf(1), math.Inf(-1)
	for _, t := range ref.top {
		listed[int(t.ID)] = float64(t.Logprob)
		least, best = min(least, float64(t.Logprob)), max(best, float64(t.Logprob))
	}
	lp, known := listed[want.id]
	tol := a.cfg.Tolerance
	switch {
	case known && !math.IsNaN(want.logprob) && math.Abs(want.logprob-lp) > tol:
		return choiceBad, fmt.Sprintf("it claims logprob %.4g, the referee's is %.4g", want.logprob, lp)
	case !known && !math.IsNaN(want.logprob) && want.logprob > least+tol:
		return choiceBad, fmt.Sprintf("it claims logprob %.4g, above the referee's least alternative %.4g", want.logprob, least)
	}
	switch {
	case d.greedy:
		if !known {
			return choiceBad, "not among the referee's top alternatives at temperature 0"
		}
		if gap := best - lp; gap > a.cfg.TieTolerance {
			return choiceBad, fmt.Sprintf("at temperature 0 it is %.4g nats below the referee's argmax (tie tolerance %.4g)", gap, a.cfg.TieTolerance)
		}
		return choiceTie, ""
	case d.filtered:
		switch {
		case known:
			return choiceTie, ""
		case d.topK > 0 && d.topK <= len(ref.top):
			return choiceBad, fmt.Sprintf("not among the referee's top alternatives, and top_k %d keeps no others", d.topK)
		}
		return choiceUnknown, "with sampling filters the kept set's boundary moves: a token off the referee's alternatives proves nothing"
	}
	mass := 0.0 // listed tokens the draw must have crossed
	lo, hi := min(want.id, ref.id), max(want.id, ref.id)
	for id, l := range listed {
		if id > lo && id < hi {
			mass += math.Exp(l)
		}
	}
	if mass > auditDrawDrift {
		return choiceBad, fmt.Sprintf("the seed's draw cannot land on it: listed tokens of mass %.3g lie between the two in draw order, more than noise moves (%.3g)", mass, auditDrawDrift)
	}
	return choiceTie, ""
}

// number reads a numeric request field.
func (c *auditCase) number(key string) (float64, bool) {
	switch t := c.req[key].(type) {
	case json.RawMessage:
		var f *float64
		if json.Unmarshal(t, &f) == nil && f != nil {
			return *f, true
		}
	case float64:
		return t, true
	case int:
		return float64(t), true
	}
	return 0, false
}

// temperature is the request's sampling temperature (OpenAI's default 1).
func (c *auditCase) temperature() float64 {
	if t, ok := c.number("temperature"); ok {
		return t
	}
	return 1
}

// seed names the request's seed in evidence.
func (c *auditCase) seed() string {
	switch s := c.req["seed"].(type) {
	case json.RawMessage:
		return string(s)
	case nil:
		return "none"
	default:
		return fmt.Sprint(s)
	}
}

// Record weights: a node's opinion weighs 1 plus its passed audits while it
// has never failed (capped); a record of recordLong passes is long enough
// to outvote a single newcomer by itself.
const (
	recordCap  = 64
	recordLong = 8
)

func (a *auditor) weight(peer string, st NodeStatus) int {
	switch {
	case a.trusted[peer]:
		return 1 << 20
	case st.Failures > 0:
		return 1
	}
	return 1 + min(st.Passes, recordCap)
}

// thirdOpinion settles a disagreement by weighing the opinions by their
// records, with a third replica's when there is one: a side wins when it
// weighs at least twice the other and has either two opinions or one with
// a long record. Otherwise neither is believed: both are disputed (their
// range runs on both, dispute.go) and the dispute waits for more opinions.
func (a *auditor) thirdOpinion(ctx context.Context, d *dispute) {
	nodes, statuses, err := a.view(ctx)
	if err != nil {
		a.keepDispute(d)
		return
	}
	h := d.c.rt.Hops[d.hop]
	wa, wb := a.weight(d.a, statuses[d.a]), a.weight(d.b, statuses[d.b])
	na, nb := 1, 1
	evidence, side := d.evidence, ""
	if third, ok := a.referee(d.a, d.c.rt.Variant, h.StartLayer, h.EndLayer, nodes, statuses, a.s.cfg.Clock(), map[string]bool{d.b: true}); ok {
		v, err := a.replay(ctx, d.c, d.hop, third)
		switch {
		case err != nil || v.n == 0 || v.unknown:
			// No opinion: the dispute stands and is retried.
			a.audits.WithLabelValues("inconclusive").Inc()
		case v.ok:
			evidence = fmt.Sprintf("%s; third opinion %s: %s", d.evidence, third.PeerID, v.detail)
			side = third.PeerID
			wa, na = wa+a.weight(third.PeerID, statuses[third.PeerID]), 2
		default:
			evidence = fmt.Sprintf("%s; third opinion %s: %s", d.evidence, third.PeerID, v.detail)
			wb, nb = wb+a.weight(third.PeerID, statuses[third.PeerID]), 2
			side = "-" + third.PeerID
		}
	}
	wins := func(w, n, other int, st NodeStatus) bool {
		return w >= 2*other && (n >= 2 || st.Passes >= recordLong || w >= 1<<20)
	}
	evidence = fmt.Sprintf("%s; votes by record %d (%s) against %d (%s)", evidence, wa, d.a, wb, d.b)
	switch {
	case wins(wa, na, wb, statuses[d.a]):
		a.fail(ctx, d.b, evidence)
		if strings.HasPrefix(side, "-") {
			a.fail(ctx, side[1:], evidence)
		}
		a.pass(ctx, d.a, "", NodeStatus{}, true, evidence)
		return
	case wins(wb, nb, wa, statuses[d.b]):
		a.fail(ctx, d.a, evidence)
		if side != "" && !strings.HasPrefix(side, "-") {
			a.fail(ctx, side, evidence)
		}
		a.pass(ctx, d.b, "", NodeStatus{}, true, evidence)
		return
	}
	a.audits.WithLabelValues("disputed").Inc()
	a.s.log.Warn("audit: two nodes disagree and nothing breaks the tie yet; neither is believed, their range runs on both", "peer", d.a, "other", d.b, "evidence", evidence)
	for _, p := range [][2]string{{d.a, d.b}, {d.b, d.a}} {
		a.update(ctx, p[0], func(st NodeStatus) (NodeStatus, bool) {
			return NodeStatus{Audit: AuditDisputed, Failures: st.Failures, Passes: st.Passes, With: p[1],
				Probation: st.Audit == AuditProbation || st.Audit == "" || (st.Audit == AuditDisputed && st.Probation), Detail: evidence}, true
		})
	}
	a.keepDispute(d)
}

// keepDispute keeps the case of an open dispute for its retries; past
// auditMaxDisputes the oldest case goes (its dispute is still retried,
// on a fresh session: retryDisputes).
func (a *auditor) keepDispute(d *dispute) {
	if d.c == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	k := disputeKey(d.a, d.b)
	if _, ok := a.disputes[k]; !ok && len(a.disputes) >= auditMaxDisputes {
		var oldest [2]string
		var at time.Time
		for k, o := range a.disputes {
			if at.IsZero() || o.at.Before(at) {
				oldest, at = k, o.at
			}
		}
		delete(a.disputes, oldest)
	}
	d.at = a.s.cfg.Clock()
	a.disputes[k] = d
}

// retryDisputes looks for a third opinion for each open dispute: every
// pair the stored statuses name (With), whether or not this tracker holds
// its case, each in its own goroutine (owned by RunAudits' ctx, at most
// Concurrency at once; the others wait for a later scan).
func (a *auditor) retryDisputes(ctx context.Context, nodes []NodeRecord, statuses map[string]NodeStatus) {
	open := map[[2]string]bool{}
	for id, st := range statuses {
		if st.Audit == AuditDisputed && st.With != "" {
			open[disputeKey(id, st.With)] = true
		}
	}
	a.mu.Lock()
	for k := range a.disputes {
		if !open[k] {
			delete(a.disputes, k) // settled
		}
	}
	a.mu.Unlock()
	for k := range open {
		key := "dispute " + k[0] + " " + k[1]
		a.mu.Lock()
		if a.running[key] {
			a.mu.Unlock()
			continue
		}
		select {
		case a.retrying <- struct{}{}:
		default:
			a.mu.Unlock()
			return
		}
		a.running[key] = true
		d := a.disputes[k]
		a.wg.Add(1)
		a.mu.Unlock()
		go func() {
			defer a.wg.Done()
			defer func() {
				a.mu.Lock()
				delete(a.running, key)
				a.mu.Unlock()
				<-a.retrying
			}()
			a.retryDispute(ctx, k, d, nodes, statuses)
		}()
	}
}

// retryDispute settles one dispute if it can: a side that failed meanwhile
// loses it; otherwise a third opinion is asked on the dispute's case, or,
// when this tracker does not hold it, on a fresh session through one side.
func (a *auditor) retryDispute(ctx context.Context, k [2]string, d *dispute, nodes []NodeRecord, statuses map[string]NodeStatus) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	now := a.s.cfg.Clock()
	failed := func(id string) bool {
		st := statuses[id]
		return st.Audit == AuditFailed && now.Before(st.Until)
	}
	if failed(k[0]) || failed(k[1]) || statuses[k[0]].With != k[1] && statuses[k[1]].With != k[0] {
		// Settled by another audit: the survivor of it is looked at
		// again (probation if it was on probation, else unaudited).
		for _, peer := range k {
			a.update(ctx, peer, func(st NodeStatus) (NodeStatus, bool) {
				next := AuditUnaudited
				if st.Probation {
					next = AuditProbation
				}
				return NodeStatus{Audit: next, Failures: st.Failures, Passes: st.Passes, Probation: st.Probation, Detail: st.Detail}, st.Audit == AuditDisputed
			})
		}
		return
	}
	var h wire.Hop
	if d != nil {
		h = d.c.rt.Hops[d.hop]
	} else {
		for _, r := range nodes {
			if r.PeerID == k[0] {
				h = wire.Hop{PeerID: r.PeerID, StartLayer: r.Layers[0], EndLayer: r.Layers[1]}
			}
		}
	}
	if h.PeerID == "" {
		return // offline: retried when it is back
	}
	var variant wire.Variant
	for _, r := range nodes {
		if r.PeerID == k[0] {
			variant = r.Variant
		}
	}
	if _, ok := a.referee(k[0], variant, h.StartLayer, h.EndLayer, nodes, statuses, now, map[string]bool{k[1]: true}); !ok {
		return // no third opinion yet: the dispute stands as recorded
	}
	if d == nil {
		var n NodeRecord
		for _, r := range nodes {
			if r.PeerID == k[0] {
				n = r
			}
		}
		if n.PeerID == "" {
			return // offline: retried when it is back
		}
		a.mu.Lock()
		var like *auditCase
		if len(a.recent) > 0 {
			like = a.recent[a.rng.IntN(len(a.recent))]
		}
		a.mu.Unlock()
		c, err := a.probationSession(ctx, n, nodes, statuses, like)
		if err != nil {
			return
		}
		hop := slices.IndexFunc(c.rt.Hops, func(h wire.Hop) bool { return h.PeerID == k[0] })
		if hop < 0 {
			return
		}
		c.digest = c.inputsDigest()
		d = &dispute{c: c, hop: hop, a: k[0], b: k[1], evidence: fmt.Sprintf("dispute between %s and %s (recorded), retried on inputs %s", k[0], k[1], c.digest)}
	}
	a.thirdOpinion(ctx, d)
}

// vouches reports whether a pass judged by referee ref adds to the audited
// node's record: a trusted referee's always; another's only while the
// record it builds weighs at most a quarter of the referee's own.
// Otherwise identities that referee each other farm records without bound
// (two colluders at the cap weighed 130 against an honest node's 41), and
// records earned from an honest judge would add up to outvote it (at half
// its weight, two colluders stood it off); a quarter keeps two of them at
// half its weight, which it outvotes. More colluders still stand it off:
// a dispute, not an exclusion. A mesh without trusted peers builds no records: votes there
// count opinions.
func (a *auditor) vouches(ref string, refSt, audited NodeStatus) bool {
	if a.trusted[ref] {
		return true
	}
	return refSt.Failures == 0 && 4*(1+min(audited.Passes+1, recordCap)) <= 1+min(refSt.Passes, recordCap)
}

// pass marks peer passed by referee ref (refSt: its status); its record
// grows only when the judge vouches for it. settled: a dispute was won by
// votes (no record added). While peer is disputed an audit's pass changes
// nothing: a disputed liar that behaves while every session is copied
// would otherwise leave the dispute (and its copies) and farm a record
// judged by the honest node it lies about as a referee (review of issue
// 26, finding 6); nor does the other party of a dispute vouch.
func (a *auditor) pass(ctx context.Context, peer, ref string, refSt NodeStatus, settled bool, evidence string) {
	if a.trusted[peer] {
		return
	}
	var fp string
	if rec, ok, err := a.s.reg.store.Get(ctx, peer); err == nil && ok {
		fp = rec.Variant.Fingerprint
	}
	a.update(ctx, peer, func(st NodeStatus) (NodeStatus, bool) {
		if st.Audit == AuditDisputed && !settled {
			return st, false
		}
		passes := st.Passes
		if !settled && st.With != ref && a.vouches(ref, refSt, st) {
			passes++
		}
		return NodeStatus{Audit: AuditPassed, Failures: st.Failures, Passes: passes, Detail: evidence, Fingerprint: fp}, true
	})
}

// fail routes the node around at once (its status is shared through the
// store) for a time that doubles with each failure.
func (a *auditor) fail(ctx context.Context, peer string, evidence string) {
	if a.trusted[peer] {
		a.s.log.Error("audit: a trusted peer disagrees with the others; it stays trusted", "peer", peer, "evidence", evidence)
		return
	}
	var failures int
	var d time.Duration
	var until time.Time
	a.update(ctx, peer, func(st NodeStatus) (NodeStatus, bool) {
		failures = st.Failures + 1
		d = a.cfg.Ban << min(failures-1, 20)
		if d > maxAuditBan || d <= 0 {
			d = maxAuditBan
		}
		until = a.s.cfg.Clock().Add(d)
		return NodeStatus{Audit: AuditFailed, Failures: failures, Passes: st.Passes, Until: until, Detail: evidence}, true
	})
	a.audits.WithLabelValues("failed").Inc()
	a.failures.WithLabelValues(peer).Inc()
	a.s.log.Error("audit failed: node routed around", "peer", peer, "failures", failures, "excluded_for", d, "evidence", evidence)
	a.mu.Lock()
	a.failed[peer] = until
	for id, u := range a.failed {
		if !u.After(a.s.cfg.Clock()) {
			delete(a.failed, id)
		}
	}
	a.mu.Unlock()
	a.version.Add(1)
	if err := a.s.reg.Ban(ctx, peer, d); err != nil {
		a.s.log.Error("audit: recording the ban failed", "peer", peer, "err", err)
	}
}

// update changes peer's status to next(current), read afresh under
// statusMu; next returns false to leave it. An unexpired failure is never
// overwritten by anything but another failure (or the operator's trust):
// an audit that read the node's status before another one failed it must
// not undo that.
func (a *auditor) update(ctx context.Context, peer string, next func(cur NodeStatus) (NodeStatus, bool)) bool {
	a.statusMu.Lock()
	defer a.statusMu.Unlock()
	statuses, err := a.s.reg.store.Statuses(ctx)
	if err != nil {
		a.s.log.Error("audit: reading a status failed", "peer", peer, "err", err)
		return false
	}
	cur := statuses[peer]
	cur.PeerID = peer
	st, ok := next(cur)
	if !ok {
		return false
	}
	st.PeerID = peer
	if cur.Audit == AuditFailed && a.s.cfg.Clock().Before(cur.Until) && st.Audit != AuditFailed && st.Audit != AuditTrusted {
		return false
	}
	if err := a.s.reg.SetStatus(ctx, st); err != nil {
		a.s.log.Error("audit: recording a status failed", "peer", peer, "err", err)
		return false
	}
	a.noteDisputed(st)
	return true
}

// inputsDigest names the audited inputs in logs without their text.
func (c *auditCase) inputsDigest() string {
	h := sha256.New()
	b, _ := json.Marshal(c.req)
	fmt.Fprintf(h, "%s\x00%s\x00", c.path, b)
	for _, t := range c.toks {
		fmt.Fprintf(h, "%d,", t.id)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// generate sends c's request over rt as the proxy sends a generation
// (upstreamRequest: a referee's session has a client session's shape),
// continuing after c.toks[:from], and hands each token to onTok until it
// returns false; it returns how the stream ended (when it ran to its end).
func (a *auditor) generate(ctx context.Context, c *auditCase, rt route.Route, from int, onTok func(auditToken) bool) (auditEnd, error) {
	var end auditEnd
	ids := make([]int, from)
	for i := range ids {
		ids[i] = c.toks[i].id
	}
	body, err := json.Marshal(upstreamRequest(c.req, c.chat, c.model, ids, c.max, c.maxKey, true))
	if err != nil {
		return end, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the rest of a replay that found what it needed
	a.yield(ctx, rt)
	sent := time.Now()
	last := sent
	resp, _, _, err := a.s.postToHead(ctx, rt, c.path, body)
	if err != nil {
		return end, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return end, readRefusal(resp)
	}
	n := 0
	var tail strings.Builder
	chunks := openai.NewChunkReader(resp.Body, maxHeadEvent)
	for {
		chunk, err := chunks.Next()
		if err == io.EOF {
			a.s.reg.observe(rt, n, last.Sub(sent))
			end.tail = tail.String()
			return end, nil
		}
		if errors.Is(err, openai.ErrBadChunk) {
			return end, errors.New("head sent an event that is not a JSON object")
		}
		if err != nil {
			return end, err
		}
		if chunk.Error != nil {
			return end, fmt.Errorf("head error: %.200s", chunk.Error.Message)
		}
		it, ok := itemOf(chunk, c.chat)
		if !ok {
			continue
		}
		if it.finish != "" {
			end.finish = it.finish
		}
		end.tools = end.tools || it.tools != ""
		if e := endOf(chunk); e != nil {
			end.eos = e
		}
		t, ok := tokenOf(chunk, c.chat)
		if !ok {
			tail.WriteString(it.content)
			continue
		}
		tail.Reset()
		n++
		last = time.Now()
		if !onTok(t) {
			return end, nil
		}
	}
}

// yield waits, at most Yield, while real generations are in flight on
// rt's nodes.
func (a *auditor) yield(ctx context.Context, rt route.Route) {
	deadline := time.Now().Add(a.cfg.Yield)
	for a.s.reg.busy(rt) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// busy says whether a proxied generation of this tracker uses a node of rt.
func (g *Registry) busy(rt route.Route) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, h := range rt.Hops {
		if g.inflight[h.PeerID] > 0 {
			return true
		}
	}
	return false
}

// markLogprobs asks for logprobs with top alternatives (chat: logprobs
// true and top_logprobs; completions: logprobs N), keeping a client's
// larger top.
func markLogprobs(up map[string]any, chat bool, top int) {
	if chat {
		up["logprobs"] = true
		if top > 0 {
			up["top_logprobs"] = top
		}
		return
	}
	if n, ok := jsonInt(up["logprobs"]); ok && n >= top {
		return
	}
	up["logprobs"] = top
}

// jsonInt reads an integer field of a client's request as the proxy keeps
// it (json.RawMessage, or an int the tracker set).
func jsonInt(v any) (int, bool) {
	switch x := v.(type) {
	case json.RawMessage:
		n, err := strconv.Atoi(string(x))
		return n, err == nil
	case int:
		return x, true
	}
	return 0, false
}
