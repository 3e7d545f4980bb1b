package node

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"

	"meshgpu/native"
)

// fakeStack is a native.Stack for protocol tests and benchmarks: embedding
// token t fills its row with t, every layer adds 1 to every element, and
// the logits peak at round(x[0]) mod vocab. So a route that runs each of L
// layers exactly once turns token t into token (t+L) mod vocab, and a layer
// run twice or skipped shows up as a different token. noop skips the
// arithmetic (the hop benchmark measures the protocol, not compute).
type fakeStack struct {
	cfg  native.StackConfig
	noop bool
	oom  bool // NewSession fails as a backend out of memory would
	// nanOut makes Forward write NaN, nanLogits Logits (a broken or hostile node).
	nanOut, nanLogits bool
	// constOut, when not 0, is what Forward writes to every element (a
	// node sending finite values no model produces).
	constOut float32

	mu       sync.Mutex
	forwards int // Forward calls, for tests
}

func newFakeStack(first, last, layers, hidden, vocab int) *fakeStack {
	return &fakeStack{cfg: native.StackConfig{Hidden: hidden, NumLayers: layers, First: first, Last: last,
		Vocab: vocab, HasEmbed: first == 0, HasHead: last == layers-1, MaxContext: 256}}
}

type fakeSession struct {
	n, max int
	closed bool
}

func (s *fakeSession) Len() int     { return s.n }
func (s *fakeSession) Close() error { s.closed = true; return nil }

func (f *fakeStack) Config() native.StackConfig    { return f.cfg }
func (f *fakeStack) SetTensor(native.Tensor) error { return nil }
func (f *fakeStack) Ready() error                  { return nil }
func (f *fakeStack) Close() error                  { return nil }
func (f *fakeStack) NewSession(max int) (native.Session, error) {
	if f.oom {
		return nil, &native.Error{Status: native.StatusOutOfMemory, Op: "session_new", Msg: "no memory for the KV cache"}
	}
	return &fakeSession{max: max}, nil
}

func (f *fakeStack) Embed(tokens []int32, dt native.DType, out []byte) error {
	if !f.cfg.HasEmbed {
		return &native.Error{Status: native.StatusInvalidArgument, Op: "embed", Msg: "no embeddings"}
	}
	for i, t := range tokens {
		for j := 0; j < f.cfg.Hidden; j++ {
			put(out, dt, i*f.cfg.Hidden+j, float32(t))
		}
	}
	return nil
}

func (f *fakeStack) Forward(steps []native.Step, first, last int, dt native.DType, in, out []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forwards++
	if first < f.cfg.First || last > f.cfg.Last || first > last {
		return &native.Error{Status: native.StatusInvalidArgument, Op: "forward", Msg: fmt.Sprintf("layers %d-%d outside %d-%d", first, last, f.cfg.First, f.cfg.Last)}
	}
	rows := 0
	for _, st := range steps {
		s := st.Session.(*fakeSession)
		if st.Pos > s.n {
			return &native.Error{Status: native.StatusInvalidArgument, Op: "forward", Msg: "pos beyond session length"}
		}
		if st.Pos+st.NTokens > s.max {
			return &native.Error{Status: native.StatusCapacity, Op: "forward", Msg: "session full"}
		}
		s.n = st.Pos + st.NTokens
		rows += st.NTokens
	}
	if f.noop {
		if &in[0] != &out[0] {
			copy(out, in)
		}
		return nil
	}
	add := float32(last - first + 1)
	if f.nanOut {
		add = float32(math.NaN())
	}
	for i := 0; i < rows*f.cfg.Hidden; i++ {
		if f.constOut != 0 {
			put(out, dt, i, f.constOut)
			continue
		}
		put(out, dt, i, get(in, dt, i)+add)
	}
	return nil
}

func (f *fakeStack) Logits(rows int, dt native.DType, in []byte, out []float32) error {
	if !f.cfg.HasHead {
		return &native.Error{Status: native.StatusInvalidArgument, Op: "logits", Msg: "no head"}
	}
	for r := 0; r < rows; r++ {
		peak := int(math.Round(float64(get(in, dt, r*f.cfg.Hidden)))) % f.cfg.Vocab
		for v := 0; v < f.cfg.Vocab; v++ {
			out[r*f.cfg.Vocab+v] = -float32((v - peak) * (v - peak))
			if f.nanLogits {
				out[r*f.cfg.Vocab+v] = float32(math.NaN())
			}
		}
	}
	return nil
}

func put(b []byte, dt native.DType, i int, v float32) {
	if dt == native.F32 {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		return
	}
	binary.LittleEndian.PutUint16(b[2*i:], uint16(math.Float32bits(v)>>16)) // exact for the small integers used here
}

func get(b []byte, dt native.DType, i int) float32 {
	if dt == native.F32 {
		return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*i:])) << 16)
}
