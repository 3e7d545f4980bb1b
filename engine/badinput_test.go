package engine

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/native"
)

// TestBadInputThroughEngine: misuse of a loaded model's stack gives a
// *native.Error with the right status and leaves the session usable.
func TestBadInputThroughEngine(t *testing.T) {
	dir := testenv.GoCoder(t)
	be := openCPU(t)
	for _, r := range [][2]int{{3, 2}, {0, 6}, {-1, 2}} {
		if _, err := Load(dir, Options{Backend: be, First: r[0], Last: r[1]}); err == nil {
			t.Errorf("layers %d-%d: no error", r[0], r[1])
		}
	}
	if _, err := Load(dir, Options{First: 0, Last: -1}); err == nil {
		t.Error("no backend: no error")
	}
	m := loadModel(t, dir, be, 0, 2)
	sess, err := m.Stack.NewSession(4)
	if err != nil {
		t.Fatal(err)
	}
	h := m.Config.Hidden * 4
	act := make([]byte, 5*h)
	if err := m.Stack.Embed([]int32{0, 1, 2, 3, 4}, native.F32, act); err != nil {
		t.Fatal(err)
	}
	step := func(pos, n, first, last int, buf []byte) error {
		return m.Stack.Forward([]native.Step{{Session: sess, Pos: pos, NTokens: n}}, first, last, native.F32, buf, buf)
	}
	checks := []struct {
		what string
		err  error
		want native.Status
	}{
		{"pos > len", step(1, 1, 0, 2, act[:h]), native.StatusInvalidArgument},
		{"layer outside the stack", step(0, 1, 0, 3, act[:h]), native.StatusInvalidArgument},
		{"wrong shape (short buffer)", step(0, 2, 0, 2, act[:h]), native.StatusInvalidArgument},
		{"capacity exceeded", step(0, 5, 0, 2, act), native.StatusCapacity},
		{"logits without head", m.Stack.Logits(1, native.F32, act, make([]float32, m.Config.Vocab)), native.StatusInvalidArgument},
		{"token outside vocab", m.Stack.Embed([]int32{int32(m.Config.Vocab)}, native.F32, act), native.StatusInvalidArgument},
	}
	for _, c := range checks {
		if !native.IsStatus(c.err, c.want) {
			t.Errorf("%s: %v, want status %q", c.what, c.err, c.want)
		}
	}
	if err := step(0, 4, 0, 2, act[:4*h]); err != nil || sess.Len() != 4 {
		t.Errorf("session unusable after bad input: %v, len %d", err, sess.Len())
	}
	whole := loadModel(t, dir, be, 0, -1)
	if _, err := whole.Generate(context.Background(), []int32{0, 1}, GenerateParams{MaxTokens: 1 << 20}, nil); err == nil ||
		!strings.Contains(err.Error(), "exceed the context") {
		t.Errorf("generation beyond the context: %v", err)
	}
}

// TestLoadWithoutWeights: a directory with config and tokenizer but no
// safetensors is an error, not a model with unset tensors. (A checkpoint
// missing one tensor is model.TestOpenGoCoder's case.)
func TestLoadWithoutWeights(t *testing.T) {
	dir := testenv.GoCoder(t)
	tmp := t.TempDir()
	for _, f := range []string{"config.json", "tokenizer.json", "tokenizer_config.json"} {
		if err := os.Symlink(filepath.Join(dir, f), filepath.Join(tmp, f)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Load(tmp, Options{Backend: openCPU(t), First: 0, Last: -1}); err == nil || !strings.Contains(err.Error(), "model.safetensors") {
		t.Errorf("no safetensors: %v, want an error naming model.safetensors", err)
	}
}

// A context longer than a sliding window would silently attend too far back:
// refused; within the window the full-cache attention is exact.
func TestSlidingWindowBoundsContext(t *testing.T) {
	cfg := &model.Config{Hidden: 64, Intermediate: 128, NumLayers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		Vocab: 256, RMSEps: 1e-5, Rope: model.RopeConfig{Type: "default", Theta: 10000}, MaxPositions: 32768, SlidingWindow: 4096}
	if _, err := StackConfig(cfg, 0, 1, 8192); err == nil || !strings.Contains(err.Error(), "sliding window") {
		t.Fatalf("context 8192 over a 4096 window: err %v, want a sliding-window error", err)
	}
	sc, err := StackConfig(cfg, 0, 1, 0)
	if err != nil || sc.MaxContext != 4096 {
		t.Fatalf("default context with a 4096 window: %d, %v; want 4096", sc.MaxContext, err)
	}
	if _, err := StackConfig(cfg, 0, 1, 4096); err != nil {
		t.Fatalf("context equal to the window: %v", err)
	}
}
