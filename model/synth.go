package model

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// synthShapes are the model shapes Synth can write.
var synthShapes = map[string]func() *Config{
	// tiny uses default RoPE and an untied head, the paths gocoder-6m
	// (llama3 RoPE, tied) does not cover.
	"tiny": func() *Config {
		return &Config{Hidden: 64, Intermediate: 128, NumLayers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
			Vocab: 512, MaxPositions: 2048, Rope: RopeConfig{Type: "default", Theta: 10000}}
	},
	"llama-3.2-1b": func() *Config {
		return &Config{Hidden: 2048, Intermediate: 8192, NumLayers: 16, Heads: 32, KVHeads: 8, HeadDim: 64,
			Vocab: 128256, MaxPositions: 131072, TieEmbeddings: true,
			Rope: RopeConfig{Type: "llama3", Theta: 500000, Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}}
	},
	"llama-3.1-8b": func() *Config {
		return &Config{Hidden: 4096, Intermediate: 14336, NumLayers: 32, Heads: 32, KVHeads: 8, HeadDim: 128,
			Vocab: 128256, MaxPositions: 131072,
			Rope: RopeConfig{Type: "llama3", Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}}
	},
}

// SynthShapeNames lists the shapes Synth accepts, sorted.
func SynthShapeNames() []string {
	names := make([]string, 0, len(synthShapes))
	for n := range synthShapes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// SynthConfig is the config of a synthesized shape; layers > 0 overrides
// the layer count.
func SynthConfig(shape string, layers int) (*Config, error) {
	mk, ok := synthShapes[shape]
	if !ok {
		return nil, fmt.Errorf("unknown shape %q (want one of %s)", shape, strings.Join(SynthShapeNames(), ", "))
	}
	c := mk()
	c.Architecture, c.ModelType = "LlamaForCausalLM", "llama"
	c.RMSEps = 1e-5
	c.TorchDType = "bfloat16"
	bos, eos := synthSpecialIDs()
	c.BOS, c.EOS = bos, []int{eos}
	if layers < 0 {
		return nil, fmt.Errorf("layer count must be > 0, got %d", layers)
	}
	if layers > 0 {
		c.NumLayers = layers
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// SynthOptions configures Synth.
type SynthOptions struct {
	Shape  string // one of SynthShapeNames
	Layers int    // overrides the shape's layer count when > 0
	// Vocab overrides the shape's vocabulary size when > 0 (a random draft
	// model for a real one needs its vocabulary); the synthesized tokenizer
	// uses the first ids.
	Vocab int
	Seed  uint64 // same seed, same bytes
	// Force overwrites an existing model in the directory.
	Force bool
	// Progress, when set, is called after each chunk of weights is written.
	Progress func(done, total int64)
}

// config is the shape's config with the options' overrides.
func (opts SynthOptions) config() (*Config, error) {
	cfg, err := SynthConfig(opts.Shape, opts.Layers)
	if err != nil {
		return nil, err
	}
	if opts.Vocab > 0 {
		if opts.Vocab < synthTokenizerSize || opts.Vocab > 1<<20 {
			return nil, fmt.Errorf("vocabulary %d: want %d to %d (the synthesized tokenizer uses %d ids)", opts.Vocab, synthTokenizerSize, 1<<20, synthTokenizerSize)
		}
		cfg.Vocab = opts.Vocab
	}
	return cfg, nil
}

// synthFiles are the files Synth writes; it refuses to overwrite them
// unless forced.
var synthFiles = []string{"config.json", singleFile, indexFile, "tokenizer.json", "tokenizer_config.json", "generation_config.json"}

// Synth writes a random-weight Hugging Face model directory: config.json,
// model.safetensors (bf16, streamed), tokenizer.json, tokenizer_config.json
// and generation_config.json. Weights are scaled so activations stay O(1):
// projections uniform with std 1/sqrt(in), norms 1 +- 0.05, embeddings std
// 1/sqrt(hidden).
func Synth(ctx context.Context, dir string, opts SynthOptions) (*Config, error) {
	cfg, err := opts.config()
	if err != nil {
		return nil, err
	}
	if !opts.Force {
		for _, f := range synthFiles {
			if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
				return nil, fmt.Errorf("%s already holds %s; choose an empty directory or force overwriting (--force)", dir, f)
			}
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	specs := synthSpecs(cfg)
	var total int64
	for _, s := range specs {
		total += s.bytes()
	}
	need := total
	if st, err := os.Stat(filepath.Join(dir, singleFile)); err == nil && opts.Force {
		need -= st.Size() // replaced once the new file is complete
	}
	if err := checkFreeSpace(dir, need); err != nil {
		return nil, err
	}
	if opts.Force {
		os.Remove(filepath.Join(dir, indexFile)) // Open prefers model.safetensors; a stale index would only mislead
	}
	final := filepath.Join(dir, singleFile)
	tmp := final + ".partial"
	if err := writeSynthWeights(ctx, tmp, cfg, specs, opts, total); err != nil {
		os.Remove(tmp)
		return nil, err
	}
	if err := os.Rename(tmp, final); err != nil {
		os.Remove(tmp)
		return nil, err
	}
	cfgJSON, err := cfg.MarshalHF()
	if err != nil {
		return nil, err
	}
	tokJSON, err := synthTokenizerJSON()
	if err != nil {
		return nil, err
	}
	tokCfgJSON, err := synthTokenizerConfigJSON(cfg.MaxPositions)
	if err != nil {
		return nil, err
	}
	genJSON := fmt.Sprintf("{\n  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n  \"do_sample\": false\n}\n", cfg.BOS, cfg.EOS[0])
	for _, f := range []struct {
		name string
		data []byte
	}{
		{"config.json", append(cfgJSON, '\n')},
		{"tokenizer.json", tokJSON},
		{"tokenizer_config.json", tokCfgJSON},
		{"generation_config.json", []byte(genJSON)},
	} {
		if err := os.WriteFile(filepath.Join(dir, f.name), f.data, 0o644); err != nil {
			return nil, err
		}
	}
	return cfg, nil
}

// synthSpecs lists every tensor in file order: embeddings, layers in order
// (so a node's layers are contiguous on disk), final norm, LM head.
func synthSpecs(cfg *Config) []WriteSpec {
	var specs []WriteSpec
	for _, s := range cfg.Tensors(0, cfg.NumLayers-1, true, true) {
		specs = append(specs, WriteSpec{s.Name, BF16, s.Shape})
	}
	return specs
}

func checkFreeSpace(dir string, need int64) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return nil // unknown; the write will say if it runs out
	}
	free := int64(st.Bavail) * int64(st.Bsize)
	if free < need+need/100 {
		return fmt.Errorf("%s has %.2f GB free; the weights need %.2f GB", dir, float64(free)/1e9, float64(need)/1e9)
	}
	return nil
}

// synthChunkElems is the unit of parallel generation: 2 MiB of bf16.
const synthChunkElems = 1 << 20

type synthChunk struct {
	buf  []byte
	done chan struct{}
}

// writeSynthWeights generates chunks on all cores and writes them in order.
// Each chunk has its own PRNG stream keyed by (seed, tensor, chunk), so the
// bytes do not depend on scheduling.
func writeSynthWeights(ctx context.Context, path string, cfg *Config, specs []WriteSpec, opts SynthOptions, total int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 4<<20)
	workers := runtime.GOMAXPROCS(0)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	// The producer queues chunks in file order; at most 2*workers are in
	// flight, which bounds memory to a few tens of MiB for any shape.
	queue := make(chan *synthChunk, 2*workers)
	sem := make(chan struct{}, workers)
	go func() {
		defer close(queue)
		for ti, s := range specs {
			n := s.bytes() / 2
			for c := int64(0); c*synthChunkElems < n; c++ {
				elems := min(n-c*synthChunkElems, synthChunkElems)
				ch := &synthChunk{buf: make([]byte, 2*elems), done: make(chan struct{})}
				select {
				case queue <- ch:
				case <-ctx.Done():
					return
				}
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					close(ch.done)
					return
				}
				go func() {
					defer func() { <-sem; close(ch.done) }()
					fillSynth(ch.buf, cfg, s.Name, opts.Seed, uint64(ti), uint64(c))
				}()
			}
		}
	}()

	var done int64
	err = WriteSafetensors(bw, specs, map[string]string{"format": "pt", "generator": "meshgpu model synth"}, func(i int, w io.Writer) error {
		need := specs[i].bytes()
		for written := int64(0); written < need; {
			var ch *synthChunk
			select {
			case ch = <-queue:
			case <-ctx.Done():
				return ctx.Err()
			}
			if ch == nil {
				return errors.New("weight generator stopped early")
			}
			<-ch.done
			if err := ctx.Err(); err != nil {
				return err
			}
			if _, err := w.Write(ch.buf); err != nil {
				return err
			}
			written += int64(len(ch.buf))
			done += int64(len(ch.buf))
			if opts.Progress != nil {
				opts.Progress(done, total)
			}
		}
		return nil
	})
	cancel()
	// Drain so every generator goroutine has finished before we return.
	for ch := range queue {
		<-ch.done
	}
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// fillSynth fills buf with bf16 values for one chunk of the named tensor.
func fillSynth(buf []byte, cfg *Config, name string, seed, tensor, chunk uint64) {
	h := fnv.New64a()
	h.Write([]byte(name))
	rng := rand.NewPCG(seed^h.Sum64(), tensor<<32|chunk)
	// Uniform on [-a, a] has std a/sqrt(3).
	var std, offset float32
	switch {
	case strings.HasSuffix(name, "layernorm.weight") || name == FinalNormName:
		std, offset = 0.05/float32(math.Sqrt(3)), 1
	case name == EmbedName || name == LMHeadName:
		std = 1 / float32(math.Sqrt(float64(cfg.Hidden)))
	case strings.HasSuffix(name, DownProj):
		std = 1 / float32(math.Sqrt(float64(cfg.Intermediate)))
	case strings.HasSuffix(name, OProj):
		std = 1 / float32(math.Sqrt(float64(cfg.Heads*cfg.HeadDim)))
	default: // q, k, v, gate, up: input is the hidden state
		std = 1 / float32(math.Sqrt(float64(cfg.Hidden)))
	}
	scale := std * float32(math.Sqrt(3)) / 32768
	// Four bf16 values per 64-bit draw, stored with one write.
	i := 0
	for ; i+8 <= len(buf); i += 8 {
		u := rng.Uint64()
		v := uint64(f32ToBF16(float32(int16(u))*scale+offset)) |
			uint64(f32ToBF16(float32(int16(u>>16))*scale+offset))<<16 |
			uint64(f32ToBF16(float32(int16(u>>32))*scale+offset))<<32 |
			uint64(f32ToBF16(float32(int16(u>>48))*scale+offset))<<48
		binary.LittleEndian.PutUint64(buf[i:], v)
	}
	if i < len(buf) { // a tail of 1-3 values
		u := rng.Uint64()
		for ; i+2 <= len(buf); i += 2 {
			binary.LittleEndian.PutUint16(buf[i:], f32ToBF16(float32(int16(u))*scale+offset))
			u >>= 16
		}
	}
}

// f32ToBF16 rounds to nearest even (inputs here are finite).
func f32ToBF16(x float32) uint16 {
	b := math.Float32bits(x)
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}
