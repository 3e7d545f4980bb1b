package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"meshgpu/model"
	"meshgpu/native"
)

// BackendConfig selects the backend the compute suites run on.
type BackendConfig struct {
	Name    string // cpu, cuda or auto (default auto)
	CUDALib string // libmeshgpu_cuda.so; empty: $MESHGPU_CUDA_LIB, then next to the executable
	Threads int    // CPU threads; 0: all cores
	CUDA    native.CUDASettings
	// CPUISA forces the CPU backend's matrix-product path (native.Options.CPUISA).
	CPUISA string
	// BaselineBytes is the buffer the bandwidth baseline streams
	// (default 256 MiB: well past any CPU cache).
	BaselineBytes int
}

func (b BackendConfig) open() (native.Backend, error) {
	name := b.Name
	if name == "" {
		name = "auto"
	}
	be, err := native.Open(name, native.Options{CUDALib: b.CUDALib, Threads: b.Threads, CUDA: b.CUDA, CPUISA: b.CPUISA})
	if err != nil {
		return nil, fmt.Errorf("backend %s: %w", name, err)
	}
	return be, nil
}

// cudaLibPath finds libmeshgpu_cuda.so the way native.Open does.
func (b BackendConfig) cudaLibPath() string {
	if b.CUDALib != "" {
		return b.CUDALib
	}
	if p := os.Getenv("MESHGPU_CUDA_LIB"); p != "" {
		return p
	}
	if exe, err := os.Executable(); err == nil {
		return filepath.Join(filepath.Dir(exe), native.CUDALibName)
	}
	return native.CUDALibName
}

// ops returns the op table of the backend be runs on.
func (b BackendConfig) ops(be native.Backend) (*native.Ops, error) {
	if be.Name() == "cuda" {
		return native.LoadCUDAOps(b.cudaLibPath())
	}
	return native.CPUOps(), nil
}

// Bandwidth is the memory bandwidth baseline a suite measures in its own run.
type Bandwidth struct {
	GBps float64 // 1e9 bytes/s
	What string
}

// measureBandwidth streams memory the way decoding streams weights: a
// multi-threaded read on CPU, a device-to-device copy on CUDA.
func (b BackendConfig) measureBandwidth(be native.Backend) (Bandwidth, error) {
	n := b.BaselineBytes
	if n <= 0 {
		n = 256 << 20
	}
	if be.Name() == "cuda" {
		ops, err := b.ops(be)
		if err != nil {
			return Bandwidth{}, err
		}
		const minCopy = 1 << 30 // large enough to leave the L2 cache behind
		gbps, err := ops.CopyGBps(uint64(max(n, minCopy)), 20)
		if err != nil {
			return Bandwidth{}, err
		}
		return Bandwidth{GBps: gbps, What: fmt.Sprintf("device-to-device copy %.0f GB/s (read+write)", gbps)}, nil
	}
	gbps, err := native.MemReadBandwidth(n, b.Threads, 3)
	if err != nil {
		return Bandwidth{}, err
	}
	threads := "all cores"
	if b.Threads > 0 {
		threads = fmt.Sprintf("%d thread(s)", b.Threads)
	}
	return Bandwidth{GBps: gbps, What: fmt.Sprintf("memory read %.1f GB/s (native membw: %d MiB, %s, best of 3)", gbps, n>>20, threads)}, nil
}

// ModelSource names a model: a Hugging Face directory, or a shape that is
// synthesized (random weights, real layout) into a cache on first use.
type ModelSource struct {
	Dir string
	// Synth is SHAPE or SHAPE:LAYERS, e.g. "tiny:16" or "llama-3.2-1b".
	Synth string
	// CacheDir keeps synthesized models (default: the user cache dir's meshgpu/synth).
	CacheDir string
}

// Open resolves the model directory (Resolve) and reads its config.
func (m ModelSource) Open(ctx context.Context) (dir string, mc *model.Config, err error) {
	if dir, err = m.Resolve(ctx); err != nil {
		return "", nil, err
	}
	mc, err = model.LoadConfig(dir)
	return dir, mc, err
}

// Resolve returns the model directory, synthesizing it when needed.
func (m ModelSource) Resolve(ctx context.Context) (string, error) {
	if m.Dir != "" {
		if _, err := model.LoadConfig(m.Dir); err != nil {
			return "", fmt.Errorf("--model %s: %w", m.Dir, err)
		}
		return m.Dir, nil
	}
	shape, layers, err := ParseSynth(m.Synth)
	if err != nil {
		return "", err
	}
	cache := m.CacheDir
	if cache == "" {
		c, err := os.UserCacheDir()
		if err != nil {
			return "", fmt.Errorf("no cache directory for synthesized models (%v); pass --cache-dir", err)
		}
		cache = filepath.Join(c, "meshgpu", "synth")
	}
	name := shape
	if layers > 0 {
		name += "-" + strconv.Itoa(layers) + "l"
	}
	dir := filepath.Join(cache, name)
	if _, err := model.LoadConfig(dir); err == nil {
		if _, err := os.Stat(filepath.Join(dir, "model.safetensors")); err == nil {
			return dir, nil
		}
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", err
	}
	// Synthesize next to the target and rename, so a crash or a concurrent
	// run never leaves a half-written model where the next run looks.
	tmp, err := os.MkdirTemp(cache, name+".tmp-")
	if err != nil {
		return "", err
	}
	if _, err := model.Synth(ctx, tmp, model.SynthOptions{Shape: shape, Layers: layers, Seed: 1}); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("synthesizing %s: %w", m.Synth, err)
	}
	os.RemoveAll(dir) // a leftover without weights
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		if _, cerr := model.LoadConfig(dir); cerr == nil {
			return dir, nil // a concurrent run got there first
		}
		return "", err
	}
	return dir, nil
}

// ParseSynth reads SHAPE or SHAPE:LAYERS.
func ParseSynth(s string) (shape string, layers int, err error) {
	shape, l, hasLayers := strings.Cut(s, ":")
	if shape == "" {
		return "", 0, errors.New("--synth: want SHAPE or SHAPE:LAYERS, e.g. tiny:16 (shapes: " + strings.Join(model.SynthShapeNames(), ", ") + ")")
	}
	if _, err := model.SynthConfig(shape, 0); err != nil {
		return "", 0, fmt.Errorf("--synth: %w", err)
	}
	if hasLayers {
		layers, err = strconv.Atoi(l)
		if err != nil || layers < 1 || layers > 256 {
			return "", 0, fmt.Errorf("--synth %s: layers must be 1 to 256", s)
		}
	}
	return shape, layers, nil
}

// weightBytesPerToken is what one decode step reads of the checkpoint in
// dir as stored (a Q4_K_M file's blocks, not their bf16 size): layers
// first..last and, with head, the final norm and the LM head (the
// embeddings when tied); not the embedding table (one row).
func weightBytesPerToken(dir string, cfg *model.Config, first, last int, head bool) (int64, error) {
	ck, err := model.Open(dir)
	if err != nil {
		return 0, err
	}
	defer ck.Close()
	b, err := layersStored(ck, cfg, first, last)
	if err != nil {
		return 0, err
	}
	if head {
		n, err := model.HeadBytesStored(ck, cfg)
		if err != nil {
			return 0, err
		}
		b += n
	}
	return b, nil
}

// rebaseline measures the bandwidth again after a suite's timed work and,
// when it is higher than bw (the first measurement caught a busy moment on a
// shared machine), rescales the report's floors and percentages to it: the
// best of the two is the closer estimate of what the memory can do.
func (b BackendConfig) rebaseline(rep *Report, be native.Backend, bw Bandwidth) error {
	after, err := b.measureBandwidth(be)
	if err != nil {
		return err
	}
	best := bw
	if after.GBps > bw.GBps {
		best = after
	}
	rep.Baseline = fmt.Sprintf("%s; before/after the suite %.1f/%.1f GB/s, the higher counts", best.What, bw.GBps, after.GBps)
	if best.GBps != bw.GBps {
		rescaleTo(rep, bw, best)
	}
	return nil
}

// rescaleTo moves a report's floors and percentages from bandwidth from to to.
func rescaleTo(rep *Report, from, best Bandwidth) {
	k := from.GBps / best.GBps // floors shrink, percentages of the floor shrink
	for i := range rep.Rows {
		r := &rep.Rows[i]
		if r.Series == SeriesBWFloor {
			r.P50, r.P99, r.Mean = r.P50*k, r.P99*k, r.Mean*k
			if r.Extra != nil {
				r.Extra["gbps"] = best.GBps
				if v, ok := r.Extra["tok_s"]; ok {
					r.Extra["tok_s"] = v / k
				}
			}
			continue
		}
		for _, key := range []string{"pct_bw", "pct_floor"} {
			if v, ok := r.Extra[key]; ok {
				r.Extra[key] = v * k
			}
		}
	}
}
