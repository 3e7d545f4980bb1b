package daemon

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"time"

	"meshgpu/engine"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/native"
	"meshgpu/node"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// shard is one loaded layer range and the server over it. A node has one
// current shard; after a move the old one keeps serving its sessions until
// they end or the grace period passes (retiring).
type shard struct {
	first, last int
	model       *engine.Model
	srv         *node.Server
	retireBy    time.Time // set when it starts retiring
}

func (n *Node) loadShard(first, last int) (*shard, error) {
	start := time.Now()
	m, err := engine.Load(n.cfg.ModelDir, engine.Options{Backend: n.cfg.Backend, First: first, Last: last, MaxContext: n.cfg.MaxContext, Progress: n.cfg.LoadProgress})
	if err != nil {
		return nil, fmt.Errorf("loading %s layers %d-%d: %w", n.cfg.ModelDir, first, last, err)
	}
	if f := n.cfg.ChatTemplateFile; f != "" && first == 0 {
		t, err := chat.LoadFile(f, m.Template)
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("chat template %s: %w", f, err)
		}
		m.Template = t
	}
	srv := &node.Server{Model: m, Backend: n.cfg.Backend, PeerID: n.id.PeerID, Identity: n.id, ModelName: n.name, Variant: n.variant,
		Route: n.cfg.Route, Peers: n.cfg.Peers, HopDType: n.cfg.HopDType,
		MaxSessions: n.cfg.MaxSessions, MaxQueue: n.cfg.MaxQueue, QueueWait: n.cfg.QueueWait, MaxBatch: n.cfg.MaxBatch, PrefillChunk: n.cfg.PrefillChunk, SessionTTL: n.cfg.SessionTTL, HopTimeout: n.cfg.HopTimeout,
		MaxInflightBytes: n.cfg.MaxInflightBytes,
		MaxContext:       n.cfg.MaxContext, Logger: n.log, Relay: n.relayc, APIAuth: n.cfg.APIAuth,
		Speculate: n.cfg.Speculate, DraftModel: n.cfg.DraftModel, SpeculateMax: n.cfg.SpeculateMax,
		SpeculateInFlight: n.cfg.SpeculateInFlight}
	srv.TrustedHeads, srv.NoHopTLS, srv.Direct = n.cfg.TrustHeads, n.cfg.NoHopTLS, n.direct
	if n.cfg.DirectReplies {
		srv.ReplyEndpoint, srv.ReplyRelay = n.hopEndpoint, n.relayAddr
	}
	if n.trackc != nil {
		srv.TicketIssuers, srv.RefreshIssuers = n.trackerKeys, n.refreshTrackers
	}
	srv.Handler() // initialise now: a bad stack fails here, not on the first request
	n.log.Info("model loaded", "model", n.cfg.ModelDir, "layers", fmt.Sprintf("%d-%d", first, last),
		"of", n.mcfg.NumLayers, "backend", n.cfg.Backend.Name(), "variant", n.variant, "took", time.Since(start).Round(time.Millisecond))
	return &shard{first: first, last: last, model: m, srv: srv}, nil
}

// close refuses new requests, waits for running ones (each has its own
// deadline), then frees the sessions and the stack.
func (s *shard) close() {
	s.srv.Drain()
	s.srv.Close()
	s.model.Close()
}

// serveHTTP sends a request to the shard that owns it: a hop or delete of a
// session a retiring shard holds goes there; everything else (new
// sessions, OpenAI requests, health) to the current shard.
func (n *Node) serveHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == wire.HopPath && r.Method == http.MethodGet {
		// A hop connection outlives shards: each Hop on it goes to its
		// session's shard (node.Shards).
		n.hops.Serve(w, r, &n.shards, n.log)
		return
	}
	if n.serveLifecycle(w, r) {
		return
	}
	for {
		srv := n.pick(r)
		if srv == nil {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"error":{"message":"node is shutting down","type":"shutting_down"}}`+"\n")
			return
		}
		if !srv.Hold() {
			continue // it began closing between pick and Hold; pick again
		}
		defer srv.Release()
		srv.Handler().ServeHTTP(w, r)
		return
	}
}

// pick is the Server that serves r (node.Shards.Pick).
func (n *Node) pick(r *http.Request) *node.Server {
	var sid string
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/forward" && r.Header.Get(wire.HeaderPosition) != "0":
		sid = r.Header.Get(wire.HeaderSession)
	case r.Method == http.MethodDelete:
		sid, _ = cutPrefix(r.URL.Path, "/sessions/")
	}
	return n.shards.Pick(sid, sid != "")
}

// publish hands the servers of the current and retiring shards to
// n.shards, which routes hops and requests to them; under n.mu, after
// every change of either.
func (n *Node) publish() {
	var cur *node.Server
	if n.cur != nil {
		cur = n.cur.srv
	}
	retiring := make([]*node.Server, len(n.retiring))
	for i, s := range n.retiring {
		retiring[i] = s.srv
	}
	n.shards.Set(cur, retiring)
}

func cutPrefix(s, p string) (string, bool) {
	if len(s) > len(p) && s[:len(p)] == p {
		return s[len(p):], true
	}
	return "", false
}

// move loads first..last, makes it current, and retires the old range
// (called by the announcer, which registers the new range right after).
func (n *Node) move(r tracker.Range) {
	if cf, cl := n.Layers(); cf == r.First && cl == r.Last {
		return
	}
	if r.First < 0 || r.First > r.Last || r.Last >= n.mcfg.NumLayers {
		n.log.Warn("ignoring an impossible move order", "first", r.First, "last", r.Last)
		return
	}
	sh, err := n.loadShard(r.First, r.Last)
	if err != nil {
		n.log.Error("move failed; keeping the current layers", "to", fmt.Sprintf("%d-%d", r.First, r.Last), "error", err)
		return
	}
	grace := n.cfg.MoveGrace
	if grace <= 0 {
		grace = DefaultMoveGrace
	}
	n.mu.Lock()
	if n.cur == nil { // closed meanwhile
		n.mu.Unlock()
		sh.close()
		return
	}
	old := n.cur
	old.retireBy = time.Now().Add(grace)
	n.cur = sh
	n.retiring = append(n.retiring, old)
	n.publish()
	n.mu.Unlock()
	n.log.Info("moved to new layers; the old range serves its sessions until they end",
		"from", fmt.Sprintf("%d-%d", old.first, old.last), "to", fmt.Sprintf("%d-%d", r.First, r.Last),
		"sessions", old.srv.Stats().Sessions, "grace", grace)
}

// retirer closes retiring shards once their sessions are gone or their
// grace period has passed.
func (n *Node) retirer(ctx context.Context) {
	defer n.wg.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n.mu.Lock()
		var done []*shard
		n.retiring = slices.DeleteFunc(n.retiring, func(s *shard) bool {
			st := s.srv.Stats()
			if st.Sessions == 0 || time.Now().After(s.retireBy) {
				// Its counters move to the base in the same step, so the
				// heartbeat's totals never go back.
				n.base.HopsOK += st.HopsOK
				n.base.HopsFailed += st.HopsFailed
				n.base.TokensGenerated += st.TokensGenerated
				n.base.Requests += st.Requests
				done = append(done, s)
				return true
			}
			return false
		})
		n.publish()
		n.mu.Unlock()
		for _, s := range done {
			sessions := s.srv.Stats().Sessions
			s.close()
			n.log.Info("retired old layers", "layers", fmt.Sprintf("%d-%d", s.first, s.last), "sessions_dropped", sessions)
		}
	}
}

// FootprintOf is a node's memory cost per ADR-0011 as the tracker counts
// it: weights in the checkpoint's dtype, a KV reserve for maxSessions
// sessions of maxContext tokens in the backend's cache dtype (f32 on the
// CPU backend, bf16 on CUDA), the embeddings for layer 0 and the LM head
// (the embeddings again when tied) for the last layer.
func FootprintOf(cfg *model.Config, backend string, maxContext, maxSessions int) tracker.Footprint {
	wt, err := model.ParseDType(cfg.TorchDType)
	if err != nil || !wt.IsFloat() {
		wt = model.BF16
	}
	kv := model.BF16
	if backend == "cpu" {
		kv = model.F32
	}
	head := cfg.HeadBytes(wt)
	if cfg.TieEmbeddings {
		head = cfg.EmbedBytes(wt)
	}
	head += int64(cfg.Hidden) * int64(wt.Size()) // final norm
	return tracker.Footprint{
		BytesPerLayer:     cfg.LayerBytes(wt),
		KVReservePerLayer: cfg.KVBytesPerToken(kv) * int64(maxContext) * int64(maxSessions),
		EmbedBytes:        cfg.EmbedBytes(wt),
		HeadBytes:         head,
	}
}

// FootprintOfCheckpoint is FootprintOf with the weights' real sizes as
// stored in ck (tensor infos, no data): each layer's own bytes (a
// quantized file's layers differ; LayerBytes is sent only when they do,
// BytesPerLayer is the largest), the embeddings and the head.
func FootprintOfCheckpoint(ck *model.Checkpoint, cfg *model.Config, backend string, maxContext, maxSessions int) (tracker.Footprint, error) {
	fp := FootprintOf(cfg, backend, maxContext, maxSessions)
	layers := make([]int64, cfg.NumLayers)
	uniform := true
	for l := range layers {
		b, err := model.LayerBytesStored(ck, cfg, l)
		if err != nil {
			return tracker.Footprint{}, err
		}
		layers[l] = b
		uniform = uniform && b == layers[0]
	}
	var err error
	if fp.EmbedBytes, err = model.EmbedBytesStored(ck, cfg); err != nil {
		return tracker.Footprint{}, err
	}
	if fp.HeadBytes, err = model.HeadBytesStored(ck, cfg); err != nil {
		return tracker.Footprint{}, err
	}
	fp.BytesPerLayer = slices.Max(layers)
	if !uniform {
		fp.LayerBytes = layers
	}
	return fp, nil
}

// weights reads what the node registers about its weights from the
// checkpoint's tensor infos: its variant and its footprint. A checkpoint
// it cannot see whole (a sharded one holding only this node's shards)
// registers the empty variant, routed only with other such nodes, and
// the footprint estimated from config.json; both are logged.
func (n *Node) weights() (wire.Variant, tracker.Footprint, error) {
	estimate := FootprintOf(n.mcfg, n.cfg.Backend.Name(), n.maxContext(), n.maxSessions())
	ck, err := model.Open(n.cfg.ModelDir)
	if err != nil {
		return wire.Variant{}, estimate, fmt.Errorf("model: %w", err)
	}
	defer ck.Close()
	var v wire.Variant
	if mv, err := model.VariantOf(ck, n.mcfg, ""); err != nil {
		n.log.Warn("cannot name the weights' variant; registering without one (routed only with nodes that send none)", "err", err)
	} else {
		v = wire.Variant{Label: mv.Label, Fingerprint: mv.Fingerprint}
	}
	fp, err := FootprintOfCheckpoint(ck, n.mcfg, n.cfg.Backend.Name(), n.maxContext(), n.maxSessions())
	if err != nil {
		n.log.Warn("cannot read every tensor's size; the memory footprint is estimated from config.json", "err", err)
		fp = estimate
	}
	return v, fp, nil
}

// probeMsPerLayer loads one layer alone and times it, for the assignment
// request (the range is not known yet).
func (n *Node) probeMsPerLayer() (float64, error) {
	l := n.mcfg.NumLayers / 2
	m, err := engine.Load(n.cfg.ModelDir, engine.Options{Backend: n.cfg.Backend, First: l, Last: l, MaxContext: 16})
	if err != nil {
		return 0, fmt.Errorf("loading layer %d to time it: %w", l, err)
	}
	defer m.Close()
	return measureMsPerLayer(m.Stack, l)
}

// measureMsPerLayer is the median time of one decode step (one token) of one
// layer, on a short dummy input.
func measureMsPerLayer(st native.Stack, layer int) (float64, error) {
	cfg := st.Config()
	sess, err := st.NewSession(8)
	if err != nil {
		return 0, fmt.Errorf("timing layer %d: %w", layer, err)
	}
	defer sess.Close()
	buf := make([]byte, cfg.Hidden*4)
	for i := 0; i < cfg.Hidden; i++ {
		v := math.Float32bits(float32(i%7-3) * 0.1)
		buf[4*i], buf[4*i+1], buf[4*i+2], buf[4*i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	const reps = 7
	times := make([]float64, 0, reps)
	for i := 0; i < reps+1; i++ {
		t0 := time.Now()
		if err := st.Forward([]native.Step{{Session: sess, Pos: i % 8, NTokens: 1}}, layer, layer, native.F32, buf, buf); err != nil {
			return 0, fmt.Errorf("timing layer %d: %w", layer, err)
		}
		if i > 0 { // the first one warms up
			times = append(times, float64(time.Since(t0).Nanoseconds())/1e6)
		}
	}
	slices.Sort(times)
	ms := times[len(times)/2]
	if ms <= 0 {
		ms = 0.001
	}
	return ms, nil
}
