package native

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// tinyConfig is a small random model: enough to exercise every code path.
func tinyConfig() StackConfig {
	return StackConfig{
		Hidden: 64, Intermediate: 96, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 50,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true,
		MaxContext: 32, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 10000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 16},
	}
}

// randomTensors lists every tensor cfg needs, random bf16 values.
func randomTensors(cfg StackConfig, seed uint64) []Tensor {
	r := rand.New(rand.NewPCG(seed, 7))
	mk := func(kind TensorKind, layer int, scale float64, base float64, shape ...int) Tensor {
		n := 1
		for _, d := range shape {
			n *= d
		}
		data := make([]byte, 2*n)
		for i := 0; i < n; i++ {
			binary.LittleEndian.PutUint16(data[2*i:], bf16(float32(base+r.NormFloat64()*scale)))
		}
		return Tensor{Kind: kind, Layer: layer, DType: BF16, Shape: shape, Data: data}
	}
	h, q, kv := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
	var ts []Tensor
	if cfg.HasEmbed {
		ts = append(ts, mk(TokEmbed, -1, 1, 0, cfg.Vocab, h))
	}
	for l := cfg.First; l <= cfg.Last; l++ {
		ts = append(ts,
			mk(AttnNorm, l, 0.1, 1, h), mk(WQ, l, 1/math.Sqrt(float64(h)), 0, q, h),
			mk(WK, l, 1/math.Sqrt(float64(h)), 0, kv, h), mk(WV, l, 1/math.Sqrt(float64(h)), 0, kv, h),
			mk(WO, l, 1/math.Sqrt(float64(q)), 0, h, q), mk(MLPNorm, l, 0.1, 1, h),
			mk(WGate, l, 1/math.Sqrt(float64(h)), 0, cfg.Intermediate, h), mk(WUp, l, 1/math.Sqrt(float64(h)), 0, cfg.Intermediate, h),
			mk(WDown, l, 1/math.Sqrt(float64(cfg.Intermediate)), 0, h, cfg.Intermediate))
		if cfg.QKVBias {
			ts = append(ts, mk(BQ, l, 0.1, 0, q), mk(BK, l, 0.1, 0, kv), mk(BV, l, 0.1, 0, kv))
		}
	}
	if cfg.HasHead {
		ts = append(ts, mk(FinalNorm, -1, 0.1, 1, h), mk(LMHead, -1, 1/math.Sqrt(float64(h)), 0, cfg.Vocab, h))
	}
	return ts
}

// bf16 rounds to nearest even, written independently of the C code.
func bf16(f float32) uint16 {
	u := math.Float32bits(f)
	if f != f {
		return uint16(u>>16) | 0x40
	}
	lsb := (u >> 16) & 1
	return uint16((u + 0x7fff + lsb) >> 16)
}

func openCPU(t testing.TB, threads int) Backend {
	t.Helper()
	b, err := Open("cpu", Options{Threads: threads})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func newStack(t testing.TB, b Backend, cfg StackConfig, seed uint64) Stack {
	t.Helper()
	st, err := b.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, ts := range randomTensors(cfg, seed) {
		if err := st.SetTensor(ts); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Ready(); err != nil {
		t.Fatal(err)
	}
	return st
}

func wantStatus(t *testing.T, what string, err error, s Status) {
	t.Helper()
	if !IsStatus(err, s) {
		t.Errorf("%s: got %v, want a *native.Error with status %q", what, err, s)
	}
}

// run embeds tokens and runs all layers at pos, returning the activations.
func run(t *testing.T, st Stack, sess Session, pos int, tokens []int32, dtype DType) []byte {
	t.Helper()
	cfg := st.Config()
	act := make([]byte, len(tokens)*cfg.Hidden*dtype.Size())
	if err := st.Embed(tokens, dtype, act); err != nil {
		t.Fatal(err)
	}
	if err := st.Forward([]Step{{Session: sess, Pos: pos, NTokens: len(tokens)}}, cfg.First, cfg.Last, dtype, act, act); err != nil {
		t.Fatal(err)
	}
	return act
}

func TestBadInput(t *testing.T) {
	b := openCPU(t, 0)
	cfg := tinyConfig()

	bad := cfg
	bad.KVHeads = 3
	_, err := b.NewStack(bad)
	wantStatus(t, "heads not a multiple of kv heads", err, StatusInvalidArgument)
	bad = cfg
	bad.First, bad.Last = 1, 5
	_, err = b.NewStack(bad)
	wantStatus(t, "layers beyond the model", err, StatusInvalidArgument)

	st, err := b.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	wantStatus(t, "ready with no tensors", st.Ready(), StatusInvalidArgument)
	ts := randomTensors(cfg, 1)
	wq := ts[3] // WK: [32, 64], not square
	if wq.Kind != WK {
		t.Fatalf("tensor order changed: %v", wq.Kind)
	}
	w := wq
	w.Shape = []int{wq.Shape[1], wq.Shape[0]}
	wantStatus(t, "transposed shape", st.SetTensor(w), StatusInvalidArgument)
	w = wq
	w.Data = wq.Data[:len(wq.Data)-2]
	wantStatus(t, "short data", st.SetTensor(w), StatusInvalidArgument)
	w = wq
	w.Layer = 2
	wantStatus(t, "layer outside the stack", st.SetTensor(w), StatusInvalidArgument)
	w = wq
	w.DType = DType(9)
	wantStatus(t, "unknown dtype", st.SetTensor(w), StatusInvalidArgument)
	w = wq
	w.Kind = BQ
	w.Shape = []int{wq.Shape[0]}
	wantStatus(t, "bias without qkv_bias", st.SetTensor(w), StatusInvalidArgument)
	for _, x := range ts {
		if err := st.SetTensor(x); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Ready(); err != nil {
		t.Fatal(err)
	}

	_, err = st.NewSession(cfg.MaxContext + 1)
	wantStatus(t, "session beyond max context", err, StatusInvalidArgument)
	sess, err := st.NewSession(8)
	if err != nil {
		t.Fatal(err)
	}
	row := cfg.Hidden * 4
	act := make([]byte, 9*row)
	wantStatus(t, "token outside the vocabulary", st.Embed([]int32{1, 50}, F32, act), StatusInvalidArgument)
	wantStatus(t, "negative token", st.Embed([]int32{-1}, F32, act), StatusInvalidArgument)
	wantStatus(t, "embed into a short buffer", st.Embed([]int32{1, 2}, F32, act[:row]), StatusInvalidArgument)
	wantStatus(t, "f16 activations", st.Embed([]int32{1}, F16, act), StatusInvalidArgument)
	wantStatus(t, "pos > len", st.Forward([]Step{{Session: sess, Pos: 1, NTokens: 1}}, 0, 1, F32, act[:row], act[:row]), StatusInvalidArgument)
	wantStatus(t, "layer outside the stack", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 1}}, 0, 2, F32, act[:row], act[:row]), StatusInvalidArgument)
	wantStatus(t, "reversed layers", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 1}}, 1, 0, F32, act[:row], act[:row]), StatusInvalidArgument)
	wantStatus(t, "short input", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 2}}, 0, 1, F32, act[:row], act), StatusInvalidArgument)
	wantStatus(t, "capacity", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 9}}, 0, 1, F32, act, act), StatusCapacity)
	wantStatus(t, "same session twice", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 1}, {Session: sess, Pos: 0, NTokens: 1}}, 0, 1, F32, act, act), StatusInvalidArgument)
	wantStatus(t, "no steps", st.Forward(nil, 0, 1, F32, act, act), StatusInvalidArgument)
	wantStatus(t, "zero tokens", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 0}}, 0, 1, F32, act, act), StatusInvalidArgument)
	if sess.Len() != 0 {
		t.Errorf("failed calls changed the session length to %d", sess.Len())
	}
	// fill to capacity, then one more
	if err := st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 8}}, 0, 1, F32, act, act); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, "capacity after fill", st.Forward([]Step{{Session: sess, Pos: 8, NTokens: 1}}, 0, 1, F32, act[:row], act[:row]), StatusCapacity)
	if sess.Len() != 8 {
		t.Errorf("session length %d after 8 tokens", sess.Len())
	}
	logits := make([]float32, cfg.Vocab)
	wantStatus(t, "short logits out", st.Logits(2, F32, act, logits), StatusInvalidArgument)

	other := newStack(t, b, cfg, 2)
	osess, _ := other.NewSession(4)
	wantStatus(t, "session of another stack", st.Forward([]Step{{Session: osess, Pos: 0, NTokens: 1}}, 0, 1, F32, act[:row], act[:row]), StatusInvalidArgument)

	mid := cfg
	mid.HasEmbed, mid.HasHead, mid.First, mid.Last, mid.NumLayers = false, false, 1, 1, 3
	ms := newStack(t, b, mid, 3)
	wantStatus(t, "embed without embeddings", ms.Embed([]int32{1}, F32, act), StatusInvalidArgument)
	wantStatus(t, "logits without head", ms.Logits(1, F32, act, logits), StatusInvalidArgument)
	w = ts[0]
	wantStatus(t, "embeddings on a middle stack", ms.SetTensor(w), StatusInvalidArgument)

	// closed objects fail cleanly
	sess.Close()
	wantStatus(t, "closed session", st.Forward([]Step{{Session: sess, Pos: 0, NTokens: 1}}, 0, 1, F32, act[:row], act[:row]), StatusInvalidArgument)
	st.Close()
	wantStatus(t, "closed stack", st.Embed([]int32{1}, F32, act), StatusInvalidArgument)
	if _, err := Open("tpu", Options{}); err == nil {
		t.Error("unknown backend name: no error")
	}
}

// TestTruncateAndBatch: a retried step (pos < len) gives the same output, and
// two sessions stepped in one Forward call equal two separate calls.
func TestTruncateAndBatch(t *testing.T) {
	b := openCPU(t, 0)
	cfg := tinyConfig()
	st := newStack(t, b, cfg, 4)
	s1, _ := st.NewSession(16)
	s2, _ := st.NewSession(16)
	a := []int32{3, 9, 27, 4, 11}
	c := []int32{7, 7, 1}
	run(t, st, s1, 0, a[:4], F32)
	first := run(t, st, s1, 4, a[4:], F32)
	retry := run(t, st, s1, 4, a[4:], F32)
	if !bytes.Equal(first, retry) || s1.Len() != 5 {
		t.Fatalf("retry at pos 4 differs (len %d)", s1.Len())
	}
	// a different token at pos 2 rewrites the cache from there
	run(t, st, s1, 2, []int32{5}, F32)
	if s1.Len() != 3 {
		t.Fatalf("truncate to 2 + 1 token: len %d", s1.Len())
	}

	// separate
	x1 := run(t, st, s1, 0, a, F32)
	x2 := run(t, st, s2, 0, c, F32)
	// batched
	row := cfg.Hidden * 4
	act := make([]byte, (len(a)+len(c))*row)
	if err := st.Embed(append(append([]int32{}, a...), c...), F32, act); err != nil {
		t.Fatal(err)
	}
	if err := st.Forward([]Step{{Session: s1, Pos: 0, NTokens: len(a)}, {Session: s2, Pos: 0, NTokens: len(c)}}, 0, 1, F32, act, act); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(act[:len(a)*row], x1) || !bytes.Equal(act[len(a)*row:], x2) {
		t.Error("batched forward differs from separate calls")
	}
	// prefill in one call equals token-by-token decode (within f32 rounding of
	// the same kernels: they are bit-identical by construction)
	s3, _ := st.NewSession(16)
	var last []byte
	for i, tok := range a {
		last = run(t, st, s3, i, []int32{tok}, F32)
	}
	if !bytes.Equal(last, x1[(len(a)-1)*row:]) {
		t.Error("token-by-token decode differs from prefill at the last position")
	}
}

// TestThreadsAndBF16: results do not depend on the thread count, and bf16
// activations are f32 rounded to nearest even.
func TestThreadsAndBF16(t *testing.T) {
	cfg := tinyConfig()
	cfg.Hidden, cfg.Intermediate, cfg.Heads, cfg.KVHeads, cfg.HeadDim = 512, 2048, 8, 4, 64 // big enough to go parallel
	cfg.QKVBias = true
	tokens := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	var outs [][]byte
	for _, th := range []int{1, 2, 3} {
		b := openCPU(t, th)
		st := newStack(t, b, cfg, 5)
		sess, _ := st.NewSession(16)
		outs = append(outs, run(t, st, sess, 0, tokens, F32))
	}
	if !bytes.Equal(outs[0], outs[1]) || !bytes.Equal(outs[0], outs[2]) {
		t.Error("forward depends on the thread count")
	}
	b := openCPU(t, 0)
	st := newStack(t, b, cfg, 5)
	f := make([]byte, len(tokens)*cfg.Hidden*4)
	h := make([]byte, len(tokens)*cfg.Hidden*2)
	if err := st.Embed(tokens, F32, f); err != nil {
		t.Fatal(err)
	}
	if err := st.Embed(tokens, BF16, h); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(h)/2; i++ {
		want := bf16(math.Float32frombits(binary.LittleEndian.Uint32(f[4*i:])))
		if got := binary.LittleEndian.Uint16(h[2*i:]); got != want {
			t.Fatalf("element %d: bf16 %#x, want %#x", i, got, want)
		}
	}
}

func TestHostBufferAndMemory(t *testing.T) {
	b := openCPU(t, 0)
	hb, err := b.AllocHost(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	if len(hb.Bytes) != 1<<16 {
		t.Fatalf("host buffer of %d bytes", len(hb.Bytes))
	}
	hb.Bytes[0], hb.Bytes[len(hb.Bytes)-1] = 1, 2
	hb.Free()
	hb.Free() // idempotent
	if _, err := b.AllocHost(0); err == nil {
		t.Error("zero-byte host buffer: no error")
	}
	free, total, err := b.Memory()
	if err != nil || total == 0 || free > total {
		t.Errorf("memory: free %d total %d err %v", free, total, err)
	}
	if gbps, err := MemReadBandwidth(64<<20, 0, 1); err != nil || !(gbps > 0) {
		t.Errorf("memory bandwidth: %v GB/s, %v", gbps, err)
	}
	if _, err := MemReadBandwidth(100, 0, 1); err == nil {
		t.Error("memory bandwidth of 100 bytes: no error")
	}
	if b.Name() != "cpu" || b.Describe() == "" {
		t.Errorf("name %q, describe %q", b.Name(), b.Describe())
	}
}

// TestPartialLayers: running part of a stack's layers is allowed, but a
// layer is never run past the positions its cache holds.
func TestPartialLayers(t *testing.T) {
	b := openCPU(t, 0)
	cfg := tinyConfig()
	st := newStack(t, b, cfg, 6)
	row := cfg.Hidden * 4
	full, _ := st.NewSession(8)
	part, _ := st.NewSession(8)
	tokens := []int32{4, 8, 15}
	want := run(t, st, full, 0, tokens, F32)
	// layer 0 then layer 1 at the same positions equals both at once
	act := make([]byte, len(tokens)*row)
	if err := st.Embed(tokens, F32, act); err != nil {
		t.Fatal(err)
	}
	for l := 0; l <= 1; l++ {
		if err := st.Forward([]Step{{Session: part, Pos: 0, NTokens: len(tokens)}}, l, l, F32, act, act); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(act, want) || part.Len() != 3 {
		t.Fatalf("layer-by-layer differs from one call (len %d)", part.Len())
	}
	// run only layer 1 for position 3: layer 0 now lags behind
	one := act[:row]
	if err := st.Forward([]Step{{Session: part, Pos: 3, NTokens: 1}}, 1, 1, F32, one, one); err != nil {
		t.Fatal(err)
	}
	err := st.Forward([]Step{{Session: part, Pos: 4, NTokens: 1}}, 0, 1, F32, one, one)
	wantStatus(t, "layer 0 past its cache", err, StatusInvalidArgument)
	if err == nil || !strings.Contains(err.Error(), "layer 0 holds only 3") {
		t.Errorf("error %v does not name the lagging layer", err)
	}
	if part.Len() != 4 {
		t.Errorf("session length %d, want 4", part.Len())
	}
}

// TestConcurrentStacks: goroutines stepping sessions of two stacks on one
// backend at once (sharing its thread pool) get the results of serial runs.
func TestConcurrentStacks(t *testing.T) {
	cfg := tinyConfig()
	cfg.Hidden, cfg.Intermediate, cfg.Heads, cfg.KVHeads, cfg.HeadDim = 512, 2048, 8, 4, 64 // parallel kernels
	b := openCPU(t, 0)
	stacks := []Stack{newStack(t, b, cfg, 8), newStack(t, b, cfg, 9)}
	tokens := [][]int32{{1, 2, 3}, {4, 5, 6, 7}}
	want := make([][]byte, 4)
	for i := range want {
		st := stacks[i%2]
		s, _ := st.NewSession(8)
		want[i] = run(t, st, s, 0, tokens[i/2], F32)
		s.Close()
	}
	errs := make(chan error, 4)
	got := make([][]byte, 4)
	for i := 0; i < 4; i++ {
		go func(i int) {
			st := stacks[i%2]
			s, err := st.NewSession(8)
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			for rep := 0; rep < 5; rep++ {
				act := make([]byte, len(tokens[i/2])*cfg.Hidden*4)
				if err := st.Embed(tokens[i/2], F32, act); err != nil {
					errs <- err
					return
				}
				if err := st.Forward([]Step{{Session: s, Pos: 0, NTokens: len(tokens[i/2])}}, 0, 1, F32, act, act); err != nil {
					errs <- err
					return
				}
				got[i] = act
				if !bytes.Equal(act, want[i]) {
					break
				}
			}
			errs <- nil
		}(i)
	}
	for i := 0; i < 4; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Errorf("goroutine %d: result differs from the serial run", i)
		}
	}
}

// TestBackendCloseFreesStacksMadeMeanwhile: a stack created while Close is
// freeing the others is freed too, not left open on a closed backend (its
// calls would run on the freed thread pool).
func TestBackendCloseFreesStacksMadeMeanwhile(t *testing.T) {
	b, err := Open("cpu", Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	be := b.(*cBackend)
	cfg := tinyConfig()
	first, err := b.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Hold the first stack busy so Close waits on it after taking the set.
	fs := first.(*cStack)
	fs.mu.Lock()
	closed := make(chan struct{})
	go func() { b.Close(); close(closed) }()
	for taken := false; !taken; {
		be.mu.Lock()
		taken = len(be.stacks) == 0
		be.mu.Unlock()
		if !taken {
			time.Sleep(time.Millisecond)
		}
	}
	late, lateErr := b.NewStack(cfg)
	fs.mu.Unlock()
	<-closed
	if lateErr != nil {
		return // refused: as good as freed
	}
	if err := late.Ready(); !IsStatus(err, StatusInvalidArgument) || !strings.Contains(err.Error(), "closed") {
		t.Errorf("stack made during Close: Ready gives %v, want a closed-stack error", err)
	}
}
