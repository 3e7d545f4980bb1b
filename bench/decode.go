package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
)

// DecodeConfig sizes the decode suite.
type DecodeConfig struct {
	Backend BackendConfig
	// Model is the model to decode (default: synthesized tiny).
	Model ModelSource
	N     int // generated tokens timed (default 32)
	// PromptTokens is the prompt length prefilled first (default 16).
	PromptTokens int
	// TorchScript is bench/torch/decode_bench.py, run for the PyTorch and HF
	// transformers rows when torch imports and the backend is cuda
	// (default: that path under the working directory).
	TorchScript string
	// TorchTimeout bounds the script (default 10 minutes).
	TorchTimeout time.Duration
}

// Series of the decode suite besides meshgpu-<backend> and bw-floor.
const (
	SeriesHF         = "hf-transformers"
	SeriesTorchGraph = "torch-cuda-graph"
)

// torchShapes maps synthesized shapes to decode_bench.py's --shapes keys.
var torchShapes = map[string]string{"llama-3.2-1b": "1b", "llama-3.1-8b": "8b"}

// Decode measures end-to-end greedy decode on one stack holding the whole
// model: each token's step (embed, all layers, final norm, LM head,
// sampling) after a prefill. tok/s and the weight bytes a token reads give
// the achieved weight bandwidth, against the memory bandwidth measured in
// the same run (bw-floor: those bytes at that bandwidth). On a GPU host with
// torch, bench/torch/decode_bench.py adds HF transformers (eager) and a
// PyTorch CUDA-graph decoder on the same shape.
func Decode(ctx context.Context, cfg DecodeConfig) (*Report, error) {
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		cfg.Model.Synth = "tiny"
	}
	if cfg.N <= 0 {
		cfg.N = 32
	}
	if cfg.PromptTokens <= 0 {
		cfg.PromptTokens = 16
	}
	if cfg.TorchScript == "" {
		cfg.TorchScript = filepath.Join("bench", "torch", "decode_bench.py")
	}
	if cfg.TorchTimeout <= 0 {
		cfg.TorchTimeout = 10 * time.Minute
	}
	dir, mc, err := cfg.Model.Open(ctx)
	if err != nil {
		return nil, err
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	bw, err := cfg.Backend.measureBandwidth(be)
	if err != nil {
		return nil, err
	}
	total := cfg.PromptTokens + cfg.N + 1
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: total})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	samples, err := decodeSteps(ctx, m, be.Name(), cfg.PromptTokens, cfg.N)
	if err != nil {
		return nil, err
	}

	bytes, err := weightBytesPerToken(dir, mc, 0, mc.NumLayers-1, true)
	if err != nil {
		return nil, err
	}
	x := float64(bytes) / 1e9
	rep := NewReport("decode", "weight GB per token", "ms/token", bw.What)
	rep.Notes = append(rep.Notes, fmt.Sprintf("model %s (%d layers, hidden %d, vocab %d) on %s (%s); greedy, batch 1, %d-token prompt",
		dir, mc.NumLayers, mc.Hidden, mc.Vocab, be.Name(), be.Describe(), cfg.PromptTokens))
	row := rep.Add("meshgpu-"+be.Name(), x, samples, nil)
	r := &rep.Rows[len(rep.Rows)-1]
	r.Extra = decodeExtra(row.P50, bytes, bw.GBps)
	floorMS := float64(bytes) / (bw.GBps * 1e9) * 1e3
	rep.Rows = append(rep.Rows, Row{Series: SeriesBWFloor, X: x, P50: floorMS, P99: floorMS, Mean: floorMS, N: 1,
		Extra: map[string]float64{"gbps": bw.GBps, "tok_s": 1e3 / floorMS}})

	if err := cfg.Backend.rebaseline(rep, be, bw); err != nil {
		return nil, err
	}
	for _, note := range torchRows(ctx, rep, cfg, be, dir, x, bytes, bw.GBps) {
		rep.Notes = append(rep.Notes, note)
	}
	return rep, nil
}

func decodeExtra(p50ms float64, bytes int64, gbps float64) map[string]float64 {
	if p50ms <= 0 {
		return nil
	}
	achieved := float64(bytes) / (p50ms * 1e-3) / 1e9
	return map[string]float64{"tok_s": 1e3 / p50ms, "gbps": achieved, "pct_bw": 100 * achieved / gbps}
}

// decodeSteps prefills prompt tokens, then times n greedy decode steps in ms.
func decodeSteps(ctx context.Context, m *engine.Model, be string, prompt, n int) ([]float64, error) {
	sess, err := m.Stack.NewSession(prompt + n + 1)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	ids := promptIDs(m, prompt)
	// Hand activations between embed, layers and head in the dtype the
	// backend computes in: f32 on CPU, bf16 (the residual stream) on CUDA.
	dt := native.F32
	if be == "cuda" {
		dt = native.BF16
	}
	step := m.LocalStepper(sess, sample.Params{}, dt)
	id, _, err := step(ctx, 0, ids, 0)
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	pos := len(ids)
	samples := make([]float64, 0, n)
	for i := 1; i <= n; i++ {
		t0 := time.Now()
		next, _, err := step(ctx, pos, []int32{id}, i)
		if err != nil {
			return nil, fmt.Errorf("decode step %d: %w", i, err)
		}
		samples = append(samples, float64(time.Since(t0).Nanoseconds())/1e6)
		id, pos = next, pos+1
	}
	return samples, nil
}

// promptIDs is n tokens of Go source (the test model writes Go), or ids
// counting up when the model has no tokenizer.
func promptIDs(m *engine.Model, n int) []int32 {
	var ids []int32
	if m.Tokenizer != nil {
		ids = m.Tokenizer.Encode(strings.Repeat("func main() {\n\tfmt.Println(\"hello, mesh\")\n}\n", 1+n/8), true)
	}
	vocab := int32(m.Config.Vocab)
	for len(ids) < n {
		ids = append(ids, int32(len(ids)+1)%vocab)
	}
	return ids[:n]
}

// torchRows runs decode_bench.py for the PyTorch rows when it can, and
// returns notes saying what ran or why not.
func torchRows(ctx context.Context, rep *Report, cfg DecodeConfig, be native.Backend, dir string, x float64, bytes int64, gbps float64) []string {
	if be.Name() != "cuda" {
		return []string{"HF transformers / PyTorch rows: skipped (they run on the GPU host with --backend cuda)"}
	}
	shape, _, _ := ParseSynth(cfg.Model.Synth)
	key, ok := torchShapes[shape]
	if cfg.Model.Dir != "" || !ok {
		return []string{"HF transformers / PyTorch rows: skipped (decode_bench.py covers the synthesized llama-3.2-1b and llama-3.1-8b shapes; use --synth)"}
	}
	if _, err := os.Stat(cfg.TorchScript); err != nil {
		return []string{fmt.Sprintf("HF transformers / PyTorch rows: skipped (no %s: %v)", cfg.TorchScript, err)}
	}
	if err := exec.CommandContext(ctx, "python3", "-c", "import torch, transformers").Run(); err != nil {
		return []string{"HF transformers / PyTorch rows: skipped (python3 cannot import torch and transformers)"}
	}
	out, err := os.MkdirTemp("", "meshgpu-torch-")
	if err != nil {
		return []string{"HF transformers / PyTorch rows: " + err.Error()}
	}
	defer os.RemoveAll(out)
	tctx, cancel := context.WithTimeout(ctx, cfg.TorchTimeout)
	defer cancel()
	cmd := exec.CommandContext(tctx, "python3", cfg.TorchScript, "--lib", cfg.Backend.cudaLibPath(),
		"--shapes", key, "--tokens", fmt.Sprint(cfg.N), "--out", out)
	log, err := cmd.CombinedOutput()
	if err != nil {
		return []string{fmt.Sprintf("HF transformers / PyTorch rows: %s failed: %v: %s", cfg.TorchScript, err, tail(log, 300))}
	}
	res, err := readTorchResults(filepath.Join(out, "bench.json"))
	if err != nil {
		return []string{"HF transformers / PyTorch rows: " + err.Error()}
	}
	var notes []string
	for _, s := range []struct{ series, key string }{{SeriesTorchGraph, key + ".torch_graph_tok_s"}, {SeriesHF, key + ".hf_eager_tok_s"}} {
		tps, ok := res[s.key]
		if !ok || tps <= 0 || math.IsNaN(tps) {
			notes = append(notes, fmt.Sprintf("%s: no %s in decode_bench.py's results", s.series, s.key))
			continue
		}
		ms := 1e3 / tps // the script reports a mean rate only
		rep.Rows = append(rep.Rows, Row{Series: s.series, X: x, P50: ms, P99: ms, Mean: ms, N: cfg.N, Extra: decodeExtra(ms, bytes, gbps)})
	}
	notes = append(notes, "torch rows: bench/torch/decode_bench.py on its own random weights of the same shape (mean rate; p99 = p50)")
	return notes
}

var nonFinite = regexp.MustCompile(`-?\bInfinity\b|\bNaN\b`)

func readTorchResults(path string) (map[string]float64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	// Python's json writes NaN and Infinity, which JSON lacks.
	data = nonFinite.ReplaceAll(data, []byte("null"))
	var raw map[string]any
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	out := map[string]float64{}
	for k, v := range raw {
		if f, ok := v.(float64); ok {
			out[k] = f
		}
	}
	if len(out) == 0 {
		return nil, errors.New(path + " holds no numbers")
	}
	return out, nil
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}
