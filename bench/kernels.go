package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"meshgpu/model"
	"meshgpu/native"
)

// KernelsConfig sizes the kernels suite.
type KernelsConfig struct {
	Backend BackendConfig
	// Shape is the synthetic model shape whose layer matrices are timed
	// (default llama-3.2-1b).
	Shape string
	// N is the timed calls per op and size (default 20).
	N int
	// Contexts are the attention context lengths (default 128, 512, 2048).
	Contexts []int
	// PrefillRows is the token count of the matmul rows (default 16).
	PrefillRows int
}

// Kernel series names.
const (
	SeriesMatvec    = "matvec"
	SeriesMatmul    = "matmul"
	SeriesRMSNorm   = "rmsnorm"
	SeriesAttention = "attention"
	SeriesBWFloor   = "bw-floor"
)

// Kernels times single ops on the backend's op table at one layer's shapes:
// matrix-vector (decode) and matrix-matrix (a prefill chunk) products, RMS
// norm and decode attention at several context lengths. x is the MiB an op
// reads; gbps is what it achieved, against the memory bandwidth measured in
// the same run (bw-floor: the time reading those bytes at that bandwidth
// takes).
//
// On CPU the op table runs the reference kernels on the calling thread, so
// the baseline is a one-thread read. On CUDA the products use the library's
// on-device probes (MatvecGBps, GemmTFLOPS) and the baseline is a
// device-to-device copy; rmsnorm and attention go through host buffers there
// and include the transfers.
func Kernels(ctx context.Context, cfg KernelsConfig) (*Report, error) {
	if cfg.Shape == "" {
		cfg.Shape = "llama-3.2-1b"
	}
	if cfg.N <= 0 {
		cfg.N = 20
	}
	if len(cfg.Contexts) == 0 {
		cfg.Contexts = []int{128, 512, 2048}
	}
	if cfg.PrefillRows <= 0 {
		cfg.PrefillRows = 16
	}
	mc, err := model.SynthConfig(cfg.Shape, 1)
	if err != nil {
		return nil, err
	}
	for _, c := range cfg.Contexts {
		if c < 1 || c > 1<<15 {
			return nil, fmt.Errorf("attention context %d: want 1 to %d", c, 1<<15)
		}
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	ops, err := cfg.Backend.ops(be)
	if err != nil {
		return nil, err
	}
	onDevice := be.Name() == "cuda"
	bc := cfg.Backend
	if !onDevice {
		bc.Threads = 1 // the CPU op table runs on the calling thread
	}
	bw, err := bc.measureBandwidth(be)
	if err != nil {
		return nil, err
	}
	rep := NewReport("kernels", "MiB read", "µs", bw.What)
	rep.LogY = true
	rep.Notes = append(rep.Notes, fmt.Sprintf("backend %s (%s); shape %s: hidden %d, intermediate %d, heads %d/%d x %d",
		be.Name(), be.Describe(), cfg.Shape, mc.Hidden, mc.Intermediate, mc.Heads, mc.KVHeads, mc.HeadDim))
	if !onDevice {
		rep.Notes = append(rep.Notes, "cpu op table: reference kernels on one thread; the inference stack uses all cores")
	} else {
		rep.Notes = append(rep.Notes, "cuda: matvec/matmul timed on device; rmsnorm and attention include host transfers")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }
	floor := func(b int64) float64 { return float64(b) / (bw.GBps * 1e9) * 1e6 }
	addRow := func(series string, bytes int64, samples []float64, extra map[string]float64) {
		if extra == nil {
			extra = map[string]float64{}
		}
		row := rep.Add(series, mib(bytes), samples, extra)
		if row.P50 > 0 {
			extra["gbps"] = float64(bytes) / (row.P50 * 1e-6) / 1e9
			extra["pct_bw"] = 100 * floor(bytes) / row.P50
		}
	}

	// The distinct matrix shapes of a layer: q/o, k/v, gate/up/down.
	kv := mc.KVHeads * mc.HeadDim
	shapes := [][2]int{{mc.Heads * mc.HeadDim, mc.Hidden}, {kv, mc.Hidden}, {mc.Intermediate, mc.Hidden}}
	for _, sh := range shapes {
		m, k := sh[0], sh[1]
		bytes := int64(m) * int64(k) * 2
		w := native.OpsWeight{DType: native.BF16, Data: randBF16(rng, m*k, 1/math.Sqrt(float64(k))), Rows: m, Cols: k}
		for _, n := range []int{1, cfg.PrefillRows} {
			x := randF32(rng, n*k)
			var samples []float64
			for i := 0; i < cfg.N; i++ {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				var us float64
				switch {
				case onDevice && n == 1:
					gbps, err := ops.MatvecGBps(m, k, 1, 10)
					if err != nil {
						return nil, err
					}
					us = float64(bytes) / (gbps * 1e9) * 1e6
				case onDevice:
					tflops, err := ops.GemmTFLOPS(m, n, k, 10)
					if err != nil {
						return nil, err
					}
					us = 2 * float64(m) * float64(n) * float64(k) / (tflops * 1e12) * 1e6
				default:
					t0 := time.Now()
					if _, err := ops.Matmul(x, w, nil, nil, n); err != nil {
						return nil, err
					}
					us = sinceUS(t0)
				}
				samples = append(samples, us)
			}
			extra := map[string]float64{"m": float64(m), "k": float64(k), "rows": float64(n)}
			if n == 1 {
				addRow(SeriesMatvec, bytes, samples, extra)
				rep.Rows = append(rep.Rows, Row{Series: SeriesBWFloor, X: mib(bytes), P50: floor(bytes), P99: floor(bytes),
					Mean: floor(bytes), N: 1, Extra: map[string]float64{"gbps": bw.GBps}})
			} else {
				addRow(SeriesMatmul, bytes, samples, extra)
				// A 16-row product is compute-bound: its rate, not bandwidth, says how it does.
				r := &rep.Rows[len(rep.Rows)-1]
				delete(r.Extra, "gbps")
				delete(r.Extra, "pct_bw")
				if r.P50 > 0 {
					r.Extra["gflops"] = 2 * float64(m) * float64(n) * float64(k) / (r.P50 * 1e-6) / 1e9
				}
			}
		}
	}

	// RMS norm of one row (decode): tiny, so its time is launch and call cost.
	{
		h := mc.Hidden
		w := native.OpsWeight{DType: native.BF16, Data: randBF16(rng, h, 0.05), Rows: h, Cols: 1}
		x := randF32(rng, h)
		samples, err := timeN(ctx, cfg.N, func() error { _, err := ops.RMSNorm(x, w, float32(mc.RMSEps), 1); return err })
		if err != nil {
			return nil, err
		}
		addRow(SeriesRMSNorm, int64(h)*(4+2), samples, map[string]float64{"hidden": float64(h)})
	}

	// Decode attention: one query row over ctx cached positions (f32 K and V).
	for _, c := range cfg.Contexts {
		q := randF32(rng, mc.Heads*mc.HeadDim)
		k := randF32(rng, c*kv)
		v := randF32(rng, c*kv)
		samples, err := timeN(ctx, cfg.N, func() error {
			_, err := ops.Attention(q, k, v, 1, c-1, mc.Heads, mc.KVHeads, mc.HeadDim, native.CUDASettings{})
			return err
		})
		if err != nil {
			return nil, err
		}
		addRow(SeriesAttention, int64(2*c*kv*4), samples, map[string]float64{"context": float64(c)})
	}
	if err := bc.rebaseline(rep, be, bw); err != nil {
		return nil, err
	}
	return rep, nil
}

func sinceUS(t0 time.Time) float64 { return float64(time.Since(t0).Nanoseconds()) / 1e3 }

// timeN calls f n times and returns each call's duration in µs.
func timeN(ctx context.Context, n int, f func() error) ([]float64, error) {
	out := make([]float64, 0, n)
	for i := 0; i < n; i++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		t0 := time.Now()
		if err := f(); err != nil {
			return nil, err
		}
		out = append(out, sinceUS(t0))
	}
	return out, nil
}

func randF32(rng *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(rng.NormFloat64())
	}
	return out
}

// randBF16 returns n bf16 values, uniform in [-scale*sqrt3, scale*sqrt3]
// (standard deviation scale).
func randBF16(rng *rand.Rand, n int, scale float64) []byte {
	out := make([]byte, 2*n)
	a := scale * math.Sqrt(3)
	for i := 0; i < n; i++ {
		f := float32((rng.Float64()*2 - 1) * a)
		binary.LittleEndian.PutUint16(out[2*i:], uint16(math.Float32bits(f)>>16))
	}
	return out
}
