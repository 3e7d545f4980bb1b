package node

import (
	"context"
	"math"
	"slices"
	"sync"
	"time"

	"meshgpu/engine"
	"meshgpu/sample"
	"meshgpu/wire"
)

// Passes in flight (DESIGN.md "Over a WAN", docs/protocol.md "Passes in
// flight"). A verify pass spends most of its round on the links while the
// nodes idle, so the head sends the next passes before the first returns:
// each drafted as if the passes before it were accepted in full, its first
// row the drafter's guess at the token the tail samples after the last
// draft. When an answer shows otherwise, the passes after it are dropped
// (their answers ignored; nodes refuse those that arrive late, wire.PassOrder)
// and the next pass is sent from the accepted position, which rolls every
// cache back as a verify pass does. Greedy output stays plain decoding's:
// a pass is used only when every row it was drafted on was right.

// Bounds on the passes one stream keeps in flight.
const (
	DefaultSpeculateInFlight = 4
	MaxSpeculateInFlight     = 16
)

// flight is one pass sent and not yet consumed.
type flight struct {
	pos, step int
	tokens    []int32 // its rows: the first token (a guess but for the oldest), then drafts
	order     wire.PassOrder
	limit     int           // the most tokens it may answer (the generation's remaining length)
	draft     time.Duration // drafting it
	compute   time.Duration // the head's layers for it
	sent      time.Time
	cancel    context.CancelFunc
	done      chan struct{} // closed once toks or ae is set
	toks      []wire.TokenReply
	ae        *apiError
}

// passWindow is one stream's passes in flight, oldest first; the decoding
// goroutine owns it (drafting, the head's layers and consuming answers run
// there, in order); each pass's send and wait runs in a goroutine of its own,
// which close cancels and waits for.
type passWindow struct {
	m     *metrics
	max   int // passes in flight at most
	fixed int // > 0: always this many (tests)
	queue []*flight
	seq   uint32 // the last pass number given
	good  uint32 // the last pass consumed: what a pass after a rollback builds on
	wg    sync.WaitGroup
	// Measured, as moving averages: a pass's round (send to answer), the
	// head's compute for one, and the fraction of passes whose successor,
	// drafted in flight, was right.
	round, compute, hit float64
	rounds              int
	reported            int // passes counted in the gauge
}

func newPassWindow(m *metrics, max, fixed int) *passWindow {
	return &passWindow{m: m, max: max, fixed: fixed, hit: 0.5}
}

// report brings the passes-in-flight gauge to w's queue.
func (w *passWindow) report() {
	w.m.inFlight(len(w.queue) - w.reported)
	w.reported = len(w.queue)
}

// want is how many passes to keep in flight: as many as fit in a round
// (the round over the head's compute for a pass: the stages' work is
// alike), no more than acceptance makes worth sending (the j-th pass is
// used with probability hit^(j-1); passes below 30% are not sent), at
// least one. Before the first answer, one.
func (w *passWindow) want() int {
	if w.fixed > 0 {
		return min(w.fixed, w.max)
	}
	if w.rounds == 0 {
		return 1
	}
	fit := int(math.Ceil(w.round / max(w.compute, 1e-4)))
	worth := w.max
	if w.hit < 0.99 {
		worth = 1 + int(math.Log(0.3)/math.Log(max(w.hit, 0.01)))
	}
	return max(1, min(fit, worth, w.max))
}

func (w *passWindow) observe(f *flight, hit bool) {
	const a = 0.25
	r := time.Since(f.sent).Seconds()
	if w.rounds == 0 {
		w.round, w.compute = r, f.compute.Seconds()
	} else {
		w.round += a * (r - w.round)
		w.compute += a * (f.compute.Seconds() - w.compute)
	}
	h := 0.0
	if hit {
		h = 1
	}
	w.hit += a * (h - w.hit)
	w.rounds++
}

// dropAll drops every pass in flight (their answers no longer matter).
func (w *passWindow) dropAll() {
	if len(w.queue) > 0 {
		w.m.passesDropped(len(w.queue))
	}
	for _, f := range w.queue {
		f.cancel()
	}
	w.queue = w.queue[:0]
	w.report()
}

// close cancels the passes in flight and waits for their goroutines.
func (w *passWindow) close() {
	for _, f := range w.queue {
		f.cancel()
	}
	w.queue = nil
	w.wg.Wait()
	w.report()
}

// launch runs a pass through the head's layers and sends it; the answer
// lands in the returned flight.
func (w *passWindow) launch(ctx context.Context, p *pipeline, pos, step, limit int, tokens []int32, verify bool, draft time.Duration) (*flight, *apiError) {
	t0 := time.Now()
	hb, _, ae := p.runHead(ctx, pos, tokens, step, verify)
	if ae != nil {
		return nil, ae
	}
	w.seq++
	after := w.good
	if n := len(w.queue); n > 0 {
		after = w.queue[n-1].order.Seq
	}
	f := &flight{pos: pos, step: step, tokens: tokens, order: wire.PassOrder{Seq: w.seq, After: after}, limit: limit,
		draft: draft, compute: time.Since(t0), sent: time.Now(), done: make(chan struct{})}
	fctx, cancel := context.WithCancel(ctx)
	f.cancel = cancel
	call := p.hopCall(pos, tokens, step, verify)
	call.pass = f.order
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		defer cancel()
		f.toks, f.ae = p.sendPass(fctx, call, hb)
		close(f.done)
	}()
	w.queue = append(w.queue, f)
	w.report()
	return f, nil
}

// inflightStepper is multiStepper with passes in flight: w's passes are
// ordered from the prompt's first token on (a node then refuses a stale
// pass that arrives late, which an unordered hop between could not stop).
func (p *pipeline) inflightStepper(w *passWindow) engine.MultiStepper {
	sp := p.spec
	plain := p.stepper().Multi()
	// draft proposes up to k tokens after hist; on a drafting failure the
	// generation goes on without drafts (as multiStepper does).
	draft := func(ctx context.Context, hist []int32, k int) ([]int32, time.Duration, *apiError) {
		if k <= 0 || sp.length.Max <= 0 {
			return nil, 0, nil
		}
		t0 := time.Now()
		d, err := sp.drafter.Propose(ctx, hist, k)
		cost := time.Since(t0)
		if err != nil {
			if ctx.Err() != nil {
				return nil, cost, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + ctx.Err().Error()}
			}
			p.s.Logger.Warn("drafting failed; decoding the rest without speculation", "session", p.id, "error", err)
			sp.length.Max = 0
			return nil, cost, nil
		}
		return d[:min(len(d), k)], cost, nil
	}
	return func(ctx context.Context, pos int, tokens []int32, step, limit int) ([]sample.Draw, error) {
		if len(tokens) != 1 {
			// the prompt (nothing is in flight before it)
			w.dropAll()
			return plain(ctx, pos, tokens, step, limit)
		}
		// The oldest pass was drafted on this very token at this position,
		// or the passes in flight are stale.
		if len(w.queue) > 0 && (w.queue[0].pos != pos || w.queue[0].tokens[0] != tokens[0]) {
			w.dropAll()
		}
		if len(w.queue) == 0 {
			k := min(sp.length.Next(), limit-1)
			hist := append(slices.Clip(p.sess.history[:pos]), tokens[0])
			drafts, cost, ae := draft(ctx, hist, k)
			if ae != nil {
				return nil, ae
			}
			if _, ae := w.launch(ctx, p, pos, step, limit, append([]int32{tokens[0]}, drafts...), len(drafts) > 0, cost); ae != nil {
				return nil, ae
			}
		}
		// Fill the window: each new pass follows the newest as if it were
		// accepted in full, its first row the drafter's guess at the token
		// after it.
		for len(w.queue) < w.want() {
			last := w.queue[len(w.queue)-1]
			n := len(last.tokens)
			left := last.limit - n
			if left < 1 {
				break
			}
			k := min(sp.length.Next(), left-1)
			// The head's history now ends with the newest pass's rows.
			guess, cost, ae := draft(ctx, slices.Clip(p.sess.history[:last.pos+n]), k+1)
			if ae != nil {
				return nil, ae
			}
			if len(guess) == 0 {
				break // nothing to guess the next token with
			}
			if _, ae := w.launch(ctx, p, last.pos+n, last.step+n, left, guess, len(guess) > 1, cost); ae != nil {
				return nil, ae
			}
		}
		f := w.queue[0]
		select {
		case <-f.done:
		case <-ctx.Done():
			return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + ctx.Err().Error()}
		}
		w.queue = w.queue[1:]
		w.report()
		if f.ae != nil {
			return nil, f.ae
		}
		w.good = f.order.Seq
		toks := f.toks[:min(len(f.toks), limit)]
		full := len(f.toks) == len(f.tokens)
		sp.length.Update(len(f.tokens)-1, len(f.toks)-1)
		p.s.metrics.speculated(sp.mode, len(f.tokens)-1, len(f.toks), f.draft)
		next := len(w.queue) > 0 && w.queue[0].tokens[0] == f.toks[len(f.toks)-1].Token
		w.observe(f, full && (next || len(w.queue) == 0))
		out := make([]sample.Draw, len(toks))
		for i, t := range toks {
			p.tokenArrived()
			out[i] = sample.Draw{ID: t.Token, Logprob: t.Logprob}
		}
		return out, nil
	}
}
