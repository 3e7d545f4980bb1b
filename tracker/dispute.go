package tracker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"meshgpu/openai"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// Disputes never deceive (issue 26): while two replicas disagree and
// nothing breaks the tie (no third replica, no trusted peer, no record
// long enough), a generation whose route runs through one of them runs on
// the other too, the same request on a route that differs only in that
// hop, and each token goes to the client only when both chose it. Where
// they differ the request fails with 503 audit_dispute: the client gets a
// text both computed, or an error that says why, never a text only one of
// them vouches for. The cost falls on the disputed range's requests only.

// TypeAuditDispute is the error type of a request refused because the
// replicas of a range it needs disagree.
const TypeAuditDispute = "audit_dispute"

// shadow is the other disputant's copy of one attempt.
type shadow struct {
	a               *auditor
	chat            bool // the copy streams chat chunks
	disputed, other string
	first, last     int
	toks            chan shadowTok
	cancel          context.CancelFunc
	done            chan struct{}
	refused         atomic.Bool
	over            bool // the copy's end was read (ended)
}

type shadowTok struct {
	item chunkItem
	err  error // the copy failed or ended (io.EOF)
}

// disputeCounts is what /nodes shows of the traffic through a disputed node.
type disputeCounts struct{ served, refused atomic.Int64 }

func (a *auditor) disputeCount(peer string) *disputeCounts {
	a.mu.Lock()
	defer a.mu.Unlock()
	c := a.disputeTraffic[peer]
	if c == nil {
		if len(a.disputeTraffic) >= 2*auditMaxDisputes {
			clear(a.disputeTraffic) // bounded: counts of old disputes go
		}
		c = &disputeCounts{}
		a.disputeTraffic[peer] = c
	}
	return c
}

// startShadow starts the copy of an attempt on rt whose body went to rt's
// head when hops of rt are under dispute: every disputed hop is replaced
// by another live, not failed replica of its variant covering its layers
// (the other disputant first). nil, nil when no hop is disputed; a refusal
// when a disputed hop has no such replica (the request is not served on
// one disputant's word). The copy belongs to ctx (the attempt's) and holds
// its route like a generation (Acquire). With nothing disputed it costs
// one map look-up per hop (the in-memory set, kept by update and scan).
func (a *auditor) startShadow(ctx context.Context, rt route.Route, path string, body []byte) (*shadow, *wire.Error) {
	if a == nil {
		return nil, nil
	}
	with := map[int]string{}
	a.mu.Lock()
	for i, h := range rt.Hops {
		if o, ok := a.disputed[h.PeerID]; ok {
			with[i] = o
		}
	}
	a.mu.Unlock()
	if len(with) == 0 {
		return nil, nil
	}
	nodes, err := a.s.reg.Nodes(ctx)
	if err != nil {
		return nil, &wire.Error{Status: http.StatusServiceUnavailable, Type: TypeAuditDispute, Code: "replicas_disagree", Message: "a range of this route is under dispute and the tracker cannot read its replicas: " + err.Error()}
	}
	statuses, err := a.s.reg.store.Statuses(ctx)
	if err != nil {
		return nil, &wire.Error{Status: http.StatusServiceUnavailable, Type: TypeAuditDispute, Code: "replicas_disagree", Message: "a range of this route is under dispute and the tracker cannot read its replicas' statuses: " + err.Error()}
	}
	now := a.s.cfg.Clock()
	srt := route.Route{Hops: slices.Clone(rt.Hops), Variant: rt.Variant}
	sh := &shadow{a: a, chat: path == "/v1/chat/completions", toks: make(chan shadowTok, 64), done: make(chan struct{})}
	for i, h := range rt.Hops {
		other, ok := with[i]
		if !ok {
			continue
		}
		model := ""
		for _, o := range nodes {
			if o.PeerID == h.PeerID {
				model = o.Model
			}
		}
		var pick *NodeRecord
		for k := range nodes {
			o := &nodes[k]
			st := statuses[o.PeerID]
			if o.PeerID == h.PeerID || o.Model != model || !o.Variant.Same(rt.Variant) ||
				o.Layers[0] > h.StartLayer || o.Layers[1] < h.EndLayer || now.Sub(o.LastSeen) > a.s.reg.timeout ||
				(st.Audit == AuditFailed && now.Before(st.Until)) {
				continue
			}
			if pick == nil || o.PeerID == other {
				pick = o
			}
		}
		if sh.disputed == "" || pick == nil {
			sh.disputed, sh.other, sh.first, sh.last = h.PeerID, other, h.StartLayer, h.EndLayer
		}
		if pick == nil {
			ae := sh.refuse("no other live replica of these layers can check it")
			sh.count()
			return nil, ae
		}
		srt.Hops[i] = wire.Hop{PeerID: pick.PeerID, Endpoint: pick.Endpoint, RelayAddr: pick.RelayAddr, StartLayer: h.StartLayer, EndLayer: h.EndLayer}
	}
	ctx, sh.cancel = context.WithCancel(ctx)
	go sh.run(ctx, srt, path, body)
	return sh, nil
}

// run streams the copy's chunks into sh.toks, ending with an error
// (io.EOF: the copy ended).
func (sh *shadow) run(ctx context.Context, rt route.Route, path string, body []byte) {
	defer close(sh.done)
	defer sh.a.s.reg.Acquire(rt)()
	send := func(t shadowTok) bool {
		select {
		case sh.toks <- t:
			return true
		case <-ctx.Done():
			return false
		}
	}
	resp, _, _, err := sh.a.s.postToHead(ctx, rt, path, body)
	if err != nil {
		send(shadowTok{err: err})
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		send(shadowTok{err: readRefusal(resp)})
		return
	}
	chunks := openai.NewChunkReader(resp.Body, maxHeadEvent)
	for {
		chunk, err := chunks.Next()
		switch {
		case err == io.EOF:
			send(shadowTok{err: io.EOF})
			return
		case errors.Is(err, openai.ErrBadChunk):
			send(shadowTok{err: fmt.Errorf("the copy's head sent %w", err)})
			return
		case err != nil:
			send(shadowTok{err: err})
			return
		case chunk.Error != nil:
			send(shadowTok{err: fmt.Errorf("the copy's head sent the error %.200s", chunk.Error.Message)})
			return
		}
		if it, ok := itemOf(chunk, sh.chat); ok && !send(shadowTok{item: it}) {
			return
		}
	}
}

// next is the copy's next chunk, or why there is none.
func (sh *shadow) next() shadowTok {
	t := time.NewTimer(sh.a.s.cfg.TokenTimeout)
	defer t.Stop()
	select {
	case got := <-sh.toks:
		return got
	case <-t.C:
		return shadowTok{err: fmt.Errorf("nothing within %v", sh.a.s.cfg.TokenTimeout)}
	}
}

// agree checks the attempt's next chunk (after n tokens of the
// generation) against the copy's: the token, the text the client reads,
// tool calls and the finish reason; at a finish the copy must end there
// too. An error refuses the request.
func (sh *shadow) agree(n int, it chunkItem) *wire.Error {
	got := sh.next()
	switch {
	case got.err != nil:
		return sh.refuse(fmt.Sprintf("the other's copy did not give token %d (%v)", n, got.err))
	case got.item != it:
		return sh.refuse(fmt.Sprintf("they differ at token %d (token %d %q finish %q against %d %q finish %q)", n, it.id, it.content, it.finish, got.item.id, got.item.content, got.item.finish))
	case it.finish != "":
		return sh.ended(n)
	}
	return nil
}

// ended checks that the copy ended where the attempt did.
// Called at the finish chunk and again at [DONE]: the copy's end is read
// once (reading it twice waited out TokenTimeout and refused answers both
// replicas agreed on).
func (sh *shadow) ended(n int) *wire.Error {
	if sh.over {
		return nil
	}
	if got := sh.next(); got.err != io.EOF {
		return sh.refuse(fmt.Sprintf("the attempt ended after token %d and the other's copy did not", n))
	}
	sh.over = true
	return nil
}

func (sh *shadow) refuse(why string) *wire.Error {
	sh.refused.Store(true)
	sh.a.s.log.Warn("dispute: request refused, the disputed replicas disagree", "peer", sh.disputed, "other", sh.other, "reason", why)
	return &wire.Error{Status: http.StatusServiceUnavailable, Type: TypeAuditDispute, Code: "replicas_disagree",
		Message: fmt.Sprintf("layers %d-%d are under dispute: nodes %s and %s disagree about their results and no third opinion or operator has settled it; %s, so this request fails rather than return a text only one of them vouches for",
			sh.first, sh.last, sh.disputed, sh.other, why)}
}

// stop ends the copy and counts the attempt.
func (sh *shadow) stop() {
	sh.cancel()
	<-sh.done
	sh.count()
}

// count counts the attempt as served or refused.
func (sh *shadow) count() {
	result := "served"
	if sh.refused.Load() {
		result = "refused"
	}
	sh.a.disputeSessions.WithLabelValues(result).Inc()
	for _, p := range []string{sh.disputed, sh.other} {
		c := sh.a.disputeCount(p)
		if sh.refused.Load() {
			c.refused.Add(1)
		} else {
			c.served.Add(1)
		}
	}
}
