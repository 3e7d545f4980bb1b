package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"meshgpu/model"
)

// The synthesized fallback: the tiny shape with six layers, so it splits
// 0-1 / 2-3 / 4-5 like gocoder-6m. A fixed seed makes every machine's copy
// the same bytes.
const (
	synthShape  = "tiny"
	synthLayers = 6
	synthSeed   = 1
)

// goCoderRel is where the test model lives beside a checkout.
var goCoderRel = filepath.Join("shared", "models", "gocoder-6m")

// resolveModel picks the model directory, in this order: opts.Model (a
// model directory, or an empty or missing directory to synthesize into),
// ../shared/models/gocoder-6m beside the working directory or the
// executable (any ancestor), else the tiny synthesized model in the cache
// directory (written once, reused after). synth reports a synthesized model.
func resolveModel(ctx context.Context, opts *Options, out io.Writer) (dir string, synth bool, err error) {
	if opts.Model != "" {
		dir = opts.Model
		switch {
		case !opts.Synth && hasModel(dir):
			return dir, false, nil
		case isEmpty(dir):
			fmt.Fprintf(out, "meshgpu demo: %s is empty: synthesizing a tiny random-weight model there\n", dir)
			return dir, true, synthesize(ctx, dir, false, opts.SynthProgress)
		case opts.Synth:
			return "", false, fmt.Errorf("model directory %s is not empty: the demo synthesizes only into an empty or new directory", dir)
		}
		return "", false, fmt.Errorf("model directory %s holds no config.json (and is not empty, so no model is synthesized there): pass a Hugging Face model directory, or an empty one", dir)
	}
	if !opts.Synth {
		if d := findGoCoder(); d != "" {
			return d, false, nil
		}
	}
	dir = opts.CacheDir
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			base = os.TempDir()
		}
		dir = filepath.Join(base, "meshgpu", fmt.Sprintf("demo-%s-%dl", synthShape, synthLayers))
	}
	if hasModel(dir) && exists(filepath.Join(dir, "model.safetensors")) {
		return dir, true, nil
	}
	// The cache is ours: a half-written model from an interrupted run is
	// overwritten.
	fmt.Fprintf(out, "meshgpu demo: no model given and gocoder-6m not found: synthesizing a tiny random-weight model into %s (once)\n", dir)
	return dir, true, synthesize(ctx, dir, true, opts.SynthProgress)
}

func synthesize(ctx context.Context, dir string, force bool, progress func(done, total int64)) error {
	_, err := model.Synth(ctx, dir, model.SynthOptions{Shape: synthShape, Layers: synthLayers, Seed: synthSeed,
		Force: force, Progress: progress})
	if err != nil {
		return fmt.Errorf("synthesizing the demo model in %s: %w", dir, err)
	}
	return nil
}

// findGoCoder looks for shared/models/gocoder-6m in every ancestor of the
// working directory and of the executable ($MESHGPU_SHARED first), so
// `go run ./cmd/meshgpu demo` in the checkout and bin/meshgpu both find it.
func findGoCoder() string {
	if d := os.Getenv("MESHGPU_SHARED"); d != "" {
		if p := filepath.Join(d, "models", "gocoder-6m"); hasModel(p) {
			return p
		}
	}
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		if r, err := filepath.EvalSymlinks(exe); err == nil {
			exe = r
		}
		starts = append(starts, filepath.Dir(exe))
	}
	for _, s := range starts {
		for dir, i := filepath.Clean(s), 0; i < 8; dir, i = filepath.Dir(dir), i+1 {
			if p := filepath.Join(dir, goCoderRel); hasModel(p) {
				return p
			}
			if dir == filepath.Dir(dir) {
				break
			}
		}
	}
	return ""
}

func hasModel(dir string) bool { return exists(filepath.Join(dir, "config.json")) }

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// isEmpty: a missing directory, or one with no entries.
func isEmpty(dir string) bool {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return true
	}
	return err == nil && len(ents) == 0
}
