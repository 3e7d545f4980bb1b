package bench

import (
	"fmt"
	"sync"

	"meshgpu/native"
)

// passStack is a native.Stack that computes nothing: Forward hands its input
// on unchanged. The hop suites serve it from a real node.Server
// (StackForTesting) so they time the protocol, not the model.
type passStack struct{ cfg native.StackConfig }

// newPassStack holds layers first..last of a model of numLayers, with no
// embeddings and no head, so every hop answers activations.
func newPassStack(first, last, numLayers, hidden int) *passStack {
	return &passStack{cfg: native.StackConfig{Hidden: hidden, Intermediate: hidden, Heads: 1, KVHeads: 1,
		HeadDim: hidden, Vocab: 1, NumLayers: numLayers, First: first, Last: last, MaxContext: 1 << 16, RMSEps: 1e-5}}
}

type passSession struct {
	mu     sync.Mutex
	n, max int
}

func (s *passSession) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}
func (s *passSession) Close() error { return nil }

func (p *passStack) Config() native.StackConfig    { return p.cfg }
func (p *passStack) SetTensor(native.Tensor) error { return nil }
func (p *passStack) Ready() error                  { return nil }
func (p *passStack) Close() error                  { return nil }

func (p *passStack) NewSession(maxTokens int) (native.Session, error) {
	if maxTokens <= 0 || maxTokens > p.cfg.MaxContext {
		return nil, &native.Error{Status: native.StatusInvalidArgument, Op: "session_new", Msg: fmt.Sprintf("max tokens %d", maxTokens)}
	}
	return &passSession{max: maxTokens}, nil
}

func (p *passStack) Embed([]int32, native.DType, []byte) error {
	return &native.Error{Status: native.StatusUnsupported, Op: "embed", Msg: "pass-through stack holds no embeddings"}
}

func (p *passStack) Logits(int, native.DType, []byte, []float32) error {
	return &native.Error{Status: native.StatusUnsupported, Op: "logits", Msg: "pass-through stack holds no head"}
}

func (p *passStack) Forward(steps []native.Step, first, last int, dt native.DType, in, out []byte) error {
	if first < p.cfg.First || last > p.cfg.Last || first > last {
		return &native.Error{Status: native.StatusInvalidArgument, Op: "forward",
			Msg: fmt.Sprintf("layers %d-%d outside %d-%d", first, last, p.cfg.First, p.cfg.Last)}
	}
	rows := 0
	for _, st := range steps {
		s, ok := st.Session.(*passSession)
		if !ok {
			return &native.Error{Status: native.StatusInvalidArgument, Op: "forward", Msg: "foreign session"}
		}
		s.mu.Lock()
		if st.Pos < 0 || st.Pos > s.n || st.Pos+st.NTokens > s.max {
			s.mu.Unlock()
			return &native.Error{Status: native.StatusCapacity, Op: "forward", Msg: fmt.Sprintf("position %d+%d with %d of %d cached", st.Pos, st.NTokens, s.n, s.max)}
		}
		s.n = st.Pos + st.NTokens
		s.mu.Unlock()
		rows += st.NTokens
	}
	need := rows * p.cfg.Hidden * dt.Size()
	if len(in) < need || len(out) < need {
		return &native.Error{Status: native.StatusInvalidArgument, Op: "forward", Msg: "buffer shorter than the steps' rows"}
	}
	copy(out[:need], in[:need])
	return nil
}
