package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"

	"meshgpu/engine"
	"meshgpu/model"
	"meshgpu/native"
)

// MemoryConfig sizes the memory suite.
type MemoryConfig struct {
	Backend BackendConfig
	Model   ModelSource
	// Layers is the range a node would serve ("a-b"; "" = all).
	Layers string
	// MaxContext is the one session's KV capacity (default 4096, as a node's).
	MaxContext int
	// Prefill, when above 0, runs one prompt of that many tokens (at most
	// MaxContext) through the session after loading and measures again:
	// the KV pages it wrote and the forward pass's scratch are then
	// resident, as on a node serving. With Prefill = MaxContext the whole
	// KV cache counts.
	Prefill int
}

// Memory loads a layer range as a node does and measures the process's
// resident memory against the floor: the stored bytes of exactly the
// tensors the range needs plus the KV cache of one session at MaxContext.
// A loader that maps or copies more than its layers shows as a ratio well
// above 1; the bound is 1.15.
func Memory(ctx context.Context, cfg MemoryConfig) (*Report, error) {
	dir, mc, err := cfg.Model.Open(ctx)
	if err != nil {
		return nil, err
	}
	first, last := 0, mc.NumLayers-1
	if cfg.Layers != "" {
		if first, last, err = model.ParseLayers(cfg.Layers, mc.NumLayers); err != nil {
			return nil, err
		}
	}
	if cfg.MaxContext <= 0 {
		cfg.MaxContext = engine.DefaultMaxContext
	}
	weights, err := storedBytes(dir, mc, first, last)
	if err != nil {
		return nil, err
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	before := readRSS()
	m, err := engine.Load(dir, engine.Options{Backend: be, First: first, Last: last, MaxContext: cfg.MaxContext})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	sess, err := m.Stack.NewSession(cfg.MaxContext)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	// The compute dtype is the backend's (f32 on the CPU, bf16 on CUDA): the
	// KV cache is sized by it.
	kvDType := model.F32
	if be.Name() == "cuda" {
		kvDType = model.BF16
	}
	kv := int64(last-first+1) * mc.KVBytesPerToken(kvDType) * int64(cfg.MaxContext)
	runtime.GC()
	debug.FreeOSMemory() // what Go freed after loading is not the node's
	after := readRSS()
	floor := weights + kv
	rep := NewReport("memory", "layers held", "MiB", fmt.Sprintf("stored bytes of the layers' tensors + KV of one %d-token session", cfg.MaxContext))
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }
	rep.Add("rss", float64(last-first+1), []float64{mib(after.rss)}, map[string]float64{
		"weights_MiB": mib(weights), "kv_MiB": mib(kv), "floor_MiB": mib(floor),
		"anon_MiB": mib(after.anon), "file_MiB": mib(after.file), "before_load_MiB": mib(before.rss),
		"rss_over_floor": float64(after.rss) / float64(floor), "peak_MiB": mib(after.peak),
	})
	rep.Notes = append(rep.Notes,
		fmt.Sprintf("model %s, layers %d-%d of %d on %s", dir, first, last, mc.NumLayers, be.Name()),
		fmt.Sprintf("RSS %.0f MiB (anon %.0f, file %.0f; %.0f before loading) = %.3fx the floor of %.0f MiB (weights %.0f + KV %.0f); peak while loading %.0f MiB",
			mib(after.rss), mib(after.anon), mib(after.file), mib(before.rss), float64(after.rss)/float64(floor), mib(floor), mib(weights), mib(kv), mib(after.peak)),
		"KV pages count once written: an idle session's cache is allocated but not yet resident")
	if cfg.Prefill > 0 {
		if cfg.Prefill > cfg.MaxContext {
			return nil, fmt.Errorf("--prefill %d: more than the session's --max-context %d", cfg.Prefill, cfg.MaxContext)
		}
		if first != 0 || last != mc.NumLayers-1 {
			return nil, fmt.Errorf("--prefill: needs all layers (the prompt's tokens enter at layer 0), not --layers %s", cfg.Layers)
		}
		dt := native.F32 // the dtype the backend computes in, as decodeSteps
		if be.Name() == "cuda" {
			dt = native.BF16
		}
		act := make([]byte, cfg.Prefill*mc.Hidden*dt.Size())
		stage := []engine.Stage{{Stack: m.Stack, Session: sess, First: m.First, Last: m.Last}}
		if err := engine.RunStep(stage, 0, cfg.Prefill, promptIDs(m, cfg.Prefill), dt, act, nil); err != nil {
			return nil, fmt.Errorf("prefill: %w", err)
		}
		act = nil
		runtime.GC()
		debug.FreeOSMemory()
		served := readRSS()
		// The file's size is the bound's other reading ("file size + KV"):
		// a GGUF's metadata and tensors the backend does not hold count too.
		fileBytes := weights
		if fi, err := os.Stat(dir); err == nil && !fi.IsDir() {
			fileBytes = fi.Size()
		}
		fileFloor := fileBytes + kv
		rep.Add("rss_after_prefill", float64(last-first+1), []float64{mib(served.rss)}, map[string]float64{
			"prefill_tokens": float64(cfg.Prefill), "floor_MiB": mib(floor), "file_MiB": mib(fileBytes), "kv_MiB": mib(kv),
			"anon_MiB": mib(served.anon), "rss_over_floor": float64(served.rss) / float64(floor),
			"rss_over_file_plus_kv": float64(served.rss) / float64(fileFloor), "peak_MiB": mib(served.peak),
		})
		rep.Notes = append(rep.Notes, fmt.Sprintf(
			"after a %d-token prefill (KV of %d of %d positions written): RSS %.0f MiB (anon %.0f) = %.3fx the floor, %.3fx the file's %.0f MiB + KV %.0f MiB (bound 1.15); peak %.0f MiB",
			cfg.Prefill, cfg.Prefill, cfg.MaxContext, mib(served.rss), mib(served.anon), float64(served.rss)/float64(floor),
			float64(served.rss)/float64(fileFloor), mib(fileBytes), mib(kv), mib(served.peak)))
	}
	return rep, nil
}

// storedBytes sums the stored size of the tensors a stack holding layers
// first..last loads (the embedding for layer 0, the final norm and head
// for the last; a tied head is the embedding, which the backend holds once).
func storedBytes(dir string, mc *model.Config, first, last int) (int64, error) {
	ck, err := model.Open(dir)
	if err != nil {
		return 0, err
	}
	defer ck.Close()
	n, err := layersStored(ck, mc, first, last)
	if err != nil {
		return 0, err
	}
	embed, err := model.EmbedBytesStored(ck, mc)
	if err != nil && first == 0 {
		return 0, err
	}
	if first == 0 {
		n += embed
	}
	if last == mc.NumLayers-1 {
		head, err := model.HeadBytesStored(ck, mc)
		if err != nil {
			return 0, err
		}
		n += head
		if first == 0 && mc.TieEmbeddings {
			n -= embed
		}
	}
	return n, nil
}

// layersStored sums the stored size of decoder layers first..last.
func layersStored(ck *model.Checkpoint, mc *model.Config, first, last int) (int64, error) {
	var n int64
	for l := first; l <= last; l++ {
		b, err := model.LayerBytesStored(ck, mc, l)
		if err != nil {
			return 0, err
		}
		n += b
	}
	return n, nil
}

type rss struct{ rss, anon, file, peak int64 }

// readRSS reads this process's resident set from /proc (zeros elsewhere).
func readRSS() rss {
	var r rss
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return r
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(v)
		if len(fields) == 0 {
			continue
		}
		kb, _ := strconv.ParseInt(fields[0], 10, 64)
		switch k {
		case "VmRSS":
			r.rss = kb << 10
		case "RssAnon":
			r.anon = kb << 10
		case "RssFile":
			r.file = kb << 10
		case "VmHWM":
			r.peak = kb << 10
		}
	}
	return r
}
