package native

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// forEachCPUISA runs f once per matrix-product path this machine supports
// (avx2 always on x86-64; avx512f and avx512bf16 where the CPU has them),
// restoring the default afterwards.
func forEachCPUISA(t *testing.T, f func(t *testing.T, isa string)) {
	t.Helper()
	isas := CPUISAs()
	if len(isas) == 0 {
		t.Fatal("no CPU path supported")
	}
	t.Cleanup(func() { SetCPUISA("") })
	for _, isa := range isas {
		t.Run(isa, func(t *testing.T) {
			if err := SetCPUISA(isa); err != nil {
				t.Fatal(err)
			}
			if got := CPUISA(); got != isa {
				t.Fatalf("CPUISA() = %q after SetCPUISA(%q)", got, isa)
			}
			f(t, isa)
		})
	}
}

// randF32 returns values that are not bf16 values (unlike randActs), so a
// path that rounds its inputs to bf16 shows it.
func randF32(r *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * scale)
	}
	return x
}

// TestMatmulEveryISA checks each path's matrix product against the float64
// Go reference on shapes with column tails (not a multiple of 32 or 16),
// several register-tile remainders and decode (n = 1):
//   - f32 paths: NMSE < 1e-10 (f32 arithmetic);
//   - avx512bf16: NMSE < 1e-10 against the reference on bf16-rounded inputs
//     (its exact semantics), and < 1e-5 (the op table's matmul parity bound)
//     against the f32 inputs where at least 256 outputs average it;
//   - every path: each token's row is bit-identical to a one-token call, so a
//     session's result does not depend on what it is batched with.
func TestMatmulEveryISA(t *testing.T) {
	seed := opsSeed(t)
	o := CPUOps()
	forEachCPUISA(t, func(t *testing.T, isa string) {
		r := rand.New(rand.NewPCG(seed, 3))
		for _, c := range []struct{ rows, cols, n int }{
			{40, 64, 5}, {67, 1000, 13}, {9, 37, 7}, {130, 2048, 1}, {130, 2048, 8}, {5, 16, 25}, {3, 48, 1},
		} {
			for _, dt := range []DType{BF16, F32} {
				what := fmt.Sprintf("%s %dx%d n=%d", dt, c.rows, c.cols, c.n)
				w, wv := randWeight(r, dt, c.rows, c.cols, 0.1)
				b, bv := randWeight(r, F32, c.rows, 1, 0.5)
				x := randF32(r, c.n*c.cols, 1)
				got, err := o.Matmul(x, w, &b, nil, c.n)
				if err != nil {
					t.Fatal(err)
				}
				want := refMatmul(f64s(x), wv, bv, c.rows, c.cols, c.n)
				if isa == "avx512bf16" && dt == BF16 {
					xr := make([]float64, len(x))
					for i, v := range x {
						xr[i] = float64(fromBF16(toBF16(v)))
					}
					if e := nmse(got, refMatmul(xr, wv, bv, c.rows, c.cols, c.n)); !(e < 1e-10) {
						t.Errorf("%s: NMSE %.3g vs the reference on bf16-rounded inputs, want < 1e-10", what, e)
					}
					// Rounding x to bf16 gives an expected NMSE near 1.3e-6;
					// over a few outputs the ratio scatters widely, so the
					// bound is for shapes with enough outputs to average.
					if e := nmse(got, want); c.rows*c.n >= 256 && !(e < 1e-5) {
						t.Errorf("%s: NMSE %.3g vs the f32 reference, want < 1e-5", what, e)
					}
				} else if e := nmse(got, want); !(e < 1e-10) {
					t.Errorf("%s: NMSE %.3g vs the reference, want < 1e-10", what, e)
				}
				for tok := 0; tok < c.n; tok++ {
					one, err := o.Matmul(x[tok*c.cols:(tok+1)*c.cols], w, &b, nil, 1)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(one, got[tok*c.rows:(tok+1)*c.rows]) {
						t.Errorf("%s: token %d alone differs from token %d in the batch", what, tok, tok)
						break
					}
				}
			}
		}
	})
}

// TestMatmulTileShapes covers the AVX2 register tiles (cpu_matmul_avx2.c,
// 3 rows x 4 tokens, from 2 tokens) on every remainder of rows and tokens,
// column counts with no 32-block or with a tail, and a prefill chunk of 512
// tokens: NMSE < 1e-10 against the float64 reference and every token
// bit-identical to a one-token call (the one-row kernel), the property that
// keeps the golden tests' bits. Tiled weights and 2 threads go through the
// backend in TestForwardMatchesReference and TestThreadsAndBF16.
func TestMatmulTileShapes(t *testing.T) {
	seed := opsSeed(t)
	o := CPUOps()
	if err := SetCPUISA("avx2"); err != nil {
		t.Skip("no avx2 path:", err)
	}
	defer SetCPUISA("")
	{
		r := rand.New(rand.NewPCG(seed, 4))
		for _, c := range []struct{ rows, cols, n int }{
			{1, 64, 2}, {2, 37, 3}, {4, 16, 4}, {5, 1000, 5}, {7, 96, 6}, {8, 2080, 7}, {67, 1000, 8}, {13, 64, 13},
			{29, 1000, 512}, {3, 2080, 1},
		} {
			what := fmt.Sprintf("bf16 %dx%d n=%d", c.rows, c.cols, c.n)
			w, wv := randWeight(r, BF16, c.rows, c.cols, 0.1)
			b, bv := randWeight(r, F32, c.rows, 1, 0.5)
			x := randF32(r, c.n*c.cols, 1)
			got, err := o.Matmul(x, w, &b, nil, c.n)
			if err != nil {
				t.Fatal(err)
			}
			if e := nmse(got, refMatmul(f64s(x), wv, bv, c.rows, c.cols, c.n)); !(e < 1e-10) {
				t.Errorf("%s: NMSE %.3g vs the reference, want < 1e-10", what, e)
			}
			for tok := 0; tok < c.n; tok++ {
				one, err := o.Matmul(x[tok*c.cols:(tok+1)*c.cols], w, &b, nil, 1)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(one, got[tok*c.rows:(tok+1)*c.rows]) {
					t.Errorf("%s: token %d alone differs from token %d in the batch", what, tok, tok)
					break
				}
			}
		}
	}
}

// TestOpsCPUMatchesGoEveryISA runs the op table on every path.
func TestOpsCPUMatchesGoEveryISA(t *testing.T) {
	forEachCPUISA(t, func(t *testing.T, isa string) { opsCPUMatchesGo(t) })
}

// TestCPUISAOption: Options.CPUISA names the path; a name the machine cannot
// run makes Open refuse with the reason.
func TestCPUISAOption(t *testing.T) {
	defer SetCPUISA("")
	names := append([]string{"avx1024"}, cpuISAs...)
	for _, name := range names {
		b, err := Open("cpu", Options{CPUISA: name})
		if !slices.Contains(CPUISAs(), name) {
			if err == nil {
				b.Close()
				t.Errorf("CPUISA %s: opened on a path this machine or build cannot run", name)
			} else if !strings.Contains(err.Error(), name) {
				t.Errorf("CPUISA %s: error %q does not name it", name, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("CPUISA %s: %v", name, err)
			continue
		}
		if CPUISA() != name {
			t.Errorf("CPUISA %s: the backend uses %s", name, CPUISA())
		}
		b.Close()
	}
}

// processCPUSeconds is the user+system time this process has used.
func processCPUSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return math.NaN()
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// BenchmarkCPUMatmulISA: one thread, a [512, 2048] f32 input times a
// [8192, 2048] bf16 weight (the 1B shape's gate projection at prefill 512)
// and the same at 64 (a prefill chunk), 8, 4 and 2 tokens (batched decode;
// where the AVX2 tiles start to pay) and 1 (decode), on every path: GFLOP/s
// (ns/op of n=8 over n=1 is the cost of a batch-8 step).
func BenchmarkCPUMatmulISA(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	o := CPUOps()
	const rows, cols = 8192, 2048
	w, _ := randWeight(r, BF16, rows, cols, 0.1)
	b.Cleanup(func() { SetCPUISA("") })
	for _, isa := range CPUISAs() {
		for _, n := range []int{512, 64, 8, 4, 2, 1} {
			x := randF32(r, n*cols, 1)
			b.Run(fmt.Sprintf("%s/n=%d", isa, n), func(b *testing.B) {
				if err := SetCPUISA(isa); err != nil {
					b.Fatal(err)
				}
				cpu0 := processCPUSeconds()
				for i := 0; i < b.N; i++ {
					if _, err := o.Matmul(x, w, nil, nil, n); err != nil {
						b.Fatal(err)
					}
				}
				flop := 2 * float64(rows) * cols * float64(n) * float64(b.N)
				b.ReportMetric(flop/b.Elapsed().Seconds()/1e9, "GFLOP/s")
				// Per CPU second: on a shared machine the wall clock counts
				// the time other processes held the core.
				b.ReportMetric(flop/(processCPUSeconds()-cpu0)/1e9, "GFLOP/cpu-s")
			})
		}
	}
}

// TestDefaultCPUISAIsMeasured: where avx512bf16 is supported the default
// is avx512bf16 when its tile measured at least 1.5x avx512f's, avx512f at
// 0.9x or less, and in between avx512bf16 on AMD only (cpu_isa.c);
// elsewhere the newest path, and the speedup reads 0.
func TestDefaultCPUISAIsMeasured(t *testing.T) {
	isas := CPUISAs()
	best := isas[len(isas)-1]
	sp := CPUBF16Speedup()
	amd := cpuinfoHas("AuthenticAMD")
	t.Logf("paths %v, default %s, avx512bf16 tile speedup %.2fx, AMD %v", isas, CPUISADefault(), sp, amd)
	want := best
	if best == "avx512bf16" && (sp <= 0.9 || sp < 1.5 && !amd) {
		want = "avx512f"
	}
	if CPUISADefault() != want {
		t.Errorf("default %s, want %s (paths %v, avx512bf16 tile %.2fx, AMD %v)", CPUISADefault(), want, isas, sp, amd)
	}
	if best == "avx512bf16" && !(sp > 0.1 && sp < 10) || best != "avx512bf16" && sp != 0 {
		t.Errorf("speedup %g: not a measurement (paths %v)", sp, isas)
	}
	SetCPUISA("")
	if CPUISA() != CPUISADefault() {
		t.Errorf("CPUISA() = %s with nothing named, default %s", CPUISA(), CPUISADefault())
	}
}

// cpuinfoHas: whether /proc/cpuinfo holds s (the vendor or a flag, read
// independently of the native code's cpuid).
func cpuinfoHas(s string) bool {
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	return strings.Contains(string(cpuinfo), s)
}

// TestPromptKernelIsMeasured: the 16-bit prompt kernel for quantized
// weights (cpu_matmul_q16prompt.c) runs by the bf16 default's banded rule
// on its own start-up reading: from 1.5x, or above 0.9x on AMD, and never
// without AVX-512 VNNI. Its bits differ from the f32 tile's, so a single
// threshold within one process's scatter let processes on one machine
// disagree.
func TestPromptKernelIsMeasured(t *testing.T) {
	setPromptQ16(-1)
	sp := CPUPromptQ16Speedup()
	amd := cpuinfoHas("AuthenticAMD")
	vnni := slices.Contains(CPUISAs(), "avx512f") && cpuinfoHas(" avx512_vnni")
	want := vnni && (sp >= 1.5 || sp > 0.9 && amd)
	t.Logf("16-bit prompt kernel %.2fx the f32 tile, AMD %v, VNNI %v: runs %v", sp, amd, vnni, CPUPromptQ16())
	if CPUPromptQ16() != want {
		t.Errorf("16-bit prompt kernel runs %v, want %v (%.2fx the f32 tile, AMD %v, VNNI %v)", CPUPromptQ16(), want, sp, amd, vnni)
	}
	if vnni && !(sp > 0.1 && sp < 10) || !vnni && sp != 0 {
		t.Errorf("speedup %g: not a measurement (VNNI %v)", sp, vnni)
	}
}

// TestBF16ProductsEveryStep: on avx512bf16, f32 steps of every length take
// bf16 products for bf16 weights, so a prompt run as one step (the prompt
// path) gets the bits of the same tokens run as short steps (decode's
// path): what an audit's referee, replaying a generation as one prefill,
// needs. In one forward call with a long and a short step each step's rows
// are bit-identical to that step run alone; both differ from avx512f's f32
// products while staying within bf16 rounding of them; a draft tree as long
// gets the short steps' bits too.
func TestBF16ProductsEveryStep(t *testing.T) {
	if !slices.Contains(CPUISAs(), "avx512bf16") {
		t.Skip("no avx512bf16 on this CPU")
	}
	t.Cleanup(func() { SetCPUISA("") })
	cfg := StackConfig{Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 32, Vocab: 64, NumLayers: 2, First: 0, Last: 1,
		HasEmbed: true, HasHead: true, MaxContext: 64, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000}}
	long := make([]int32, PromptStepMin)
	for i := range long {
		long[i] = int32(i*7) % int32(cfg.Vocab)
	}
	short := []int32{5, 9, 2}
	row := cfg.Hidden * F32.Size()
	setISA := func(isa string) {
		if err := SetCPUISA(isa); err != nil {
			t.Fatal(err)
		}
	}
	alone := func(isa string, tokens []int32) []byte {
		setISA(isa)
		st := newStack(t, openCPU(t, 2), cfg, 3)
		s, _ := st.NewSession(64)
		return run(t, st, s, 0, tokens, F32)
	}
	// the long tokens as steps shorter than PromptStepMin: decode's path
	inSteps := func(isa string) []byte {
		setISA(isa)
		st := newStack(t, openCPU(t, 2), cfg, 3)
		s, _ := st.NewSession(64)
		half := len(long) / 2
		return append(run(t, st, s, 0, long[:half], F32), run(t, st, s, half, long[half:], F32)...)
	}
	exactLong, exactShort := alone("avx512f", long), alone("avx512f", short)
	bfSteps := inSteps("avx512bf16")
	bfLong, bfShort := alone("avx512bf16", long), alone("avx512bf16", short)

	st := newStack(t, openCPU(t, 2), cfg, 3) // avx512bf16 still set
	sa, _ := st.NewSession(64)
	sb, _ := st.NewSession(64)
	both := append(append([]int32{}, short...), long...)
	act := make([]byte, len(both)*row)
	if err := st.Embed(both, F32, act); err != nil {
		t.Fatal(err)
	}
	steps := []Step{{Session: sa, Pos: 0, NTokens: len(short)}, {Session: sb, Pos: 0, NTokens: len(long)}}
	if err := st.Forward(steps, 0, 1, F32, act, act); err != nil {
		t.Fatal(err)
	}
	if string(act[:len(short)*row]) != string(bfShort) {
		t.Error("the short step batched with a long one differs from the short step alone")
	}
	if string(act[len(short)*row:]) != string(bfLong) {
		t.Error("the long step batched with a short one differs from the long step alone")
	}
	if string(bfLong) != string(bfSteps) {
		t.Errorf("a %d-token step on avx512bf16 differs from the same tokens in shorter steps: a referee's prefill would not replay decode", len(long))
	}
	// A draft tree (a speculative verify pass) of as many rows: a
	// chain-shaped tree gives the chain's bits.
	sc, _ := st.NewSession(64)
	chain := make([]int32, len(long))
	for i := range chain {
		chain[i] = int32(i) - 1
	}
	tree := make([]byte, len(long)*row)
	if err := st.Embed(long, F32, tree); err != nil {
		t.Fatal(err)
	}
	if err := st.Forward([]Step{{Session: sc, Pos: 0, NTokens: len(long), Parents: chain}}, 0, 1, F32, tree, tree); err != nil {
		t.Fatal(err)
	}
	if string(tree) != string(bfSteps) {
		t.Errorf("a %d-row draft tree on avx512bf16 differs from the chain in steps", len(long))
	}
	f32s := func(b []byte) []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }
	for _, c := range []struct {
		what      string
		bf, exact []byte
	}{{"long step", bfLong, exactLong}, {"short step", bfShort, exactShort}} {
		if string(c.bf) == string(c.exact) {
			t.Errorf("%s: avx512bf16 equals avx512f: want bf16 products", c.what)
		}
		var d, n float64
		for i, v := range f32s(c.exact) {
			e := float64(f32s(c.bf)[i]) - float64(v)
			d, n = d+e*e, n+float64(v)*float64(v)
		}
		// bf16 inputs (8 significant bits) through 2 random layers: measured
		// about 2e-3; a wrong product (a tile, a run's offset) gives errors near 1.
		if rel := math.Sqrt(d / n); !(rel < 1e-2) {
			t.Errorf("%s: hidden rel L2 %.3g between bf16 and f32 products, want < 1e-2", c.what, rel)
		}
	}
}
