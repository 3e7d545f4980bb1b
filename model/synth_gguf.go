package model

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"meshgpu/model/gguf"
	"meshgpu/model/tokenizer"

	"golang.org/x/sync/errgroup"
)

// SynthGGUF writes the model Synth writes as one GGUF file, laid out as
// llama.cpp's converter lays out a Llama checkpoint: matrices bf16 with
// q/k rows in llama.cpp's order, 1-D tensors f32, llama3 scaling as a
// rope_freqs tensor, the tokenizer and chat template in the metadata. The
// same options give the same weights as Synth's directory, so the two
// formats can be checked against each other.
func SynthGGUF(ctx context.Context, path string, opts SynthOptions) (*Config, error) {
	cfg, err := opts.config()
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(path); err == nil && !opts.Force {
		return nil, fmt.Errorf("%s already exists; choose another path or force overwriting (--force)", path)
	}
	specs := synthSpecs(cfg) // the safetensors order, which keys each tensor's random stream
	var tensors []gguf.WriteTensor
	var order []int // spec index of each GGUF tensor; -1 for rope_freqs
	var total int64
	if cfg.Rope.Type == "llama3" {
		tensors = append(tensors, gguf.WriteTensor{Name: ggufRopeFreqs, Dims: []uint64{uint64(cfg.HeadDim / 2)}, Type: gguf.F32})
		order = append(order, -1)
	}
	for i, s := range specs {
		t := gguf.WriteTensor{Name: ggufNameOf(s.Name), Type: gguf.BF16}
		for j := len(s.Shape) - 1; j >= 0; j-- {
			t.Dims = append(t.Dims, uint64(s.Shape[j]))
		}
		if len(s.Shape) == 1 {
			t.Type = gguf.F32
		}
		tensors = append(tensors, t)
		order = append(order, i)
		total += s.bytes()
	}
	if err := checkFreeSpace(filepath.Dir(path), total+total/8); err != nil {
		return nil, err
	}
	kv := synthGGUFMetadata(cfg)
	tmp := path + ".partial"
	f, err := os.Create(tmp)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp)
	bw := bufio.NewWriterSize(f, 4<<20)
	var done int64
	_, err = gguf.Write(bw, kv, tensors, func(i int, w io.Writer) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if order[i] < 0 {
			return writeF32s(w, llama3FreqFactors(cfg))
		}
		s := specs[order[i]]
		buf := synthTensor(cfg, s, opts.Seed, uint64(order[i]))
		switch {
		case len(s.Shape) == 1:
			f32 := make([]float32, len(buf)/2)
			for j := range f32 {
				f32[j] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(buf[2*j:])) << 16)
			}
			if err := writeF32s(w, f32); err != nil {
				return err
			}
		default:
			if heads := synthPermutedHeads(cfg, s.Name); heads > 0 {
				buf = reorderHeadRows(buf, len(buf)/s.Shape[0], heads, true)
			}
			if _, err := w.Write(buf); err != nil {
				return err
			}
		}
		done += s.bytes()
		if opts.Progress != nil {
			opts.Progress(done, total)
		}
		return nil
	})
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		return nil, fmt.Errorf("writing %s: %w", path, err)
	}
	return cfg, nil
}

// ggufNameOf is the GGUF name of a Hugging Face tensor name.
func ggufNameOf(hf string) string {
	for g, h := range ggufWholeNames {
		if h == hf {
			return g
		}
	}
	var layer int
	var suffix string
	if _, err := fmt.Sscanf(hf, "model.layers.%d.%s", &layer, &suffix); err == nil {
		for g, h := range ggufLayerNames {
			if h == suffix {
				return fmt.Sprintf("blk.%d.%s", layer, g)
			}
		}
	}
	return hf
}

// synthPermutedHeads is the head count of a q or k tensor, whose rows
// llama.cpp's converter reorders; 0 for every other tensor.
func synthPermutedHeads(cfg *Config, name string) int {
	switch {
	case strings.HasSuffix(name, QProj):
		return cfg.Heads
	case strings.HasSuffix(name, KProj):
		return cfg.KVHeads
	}
	return 0
}

// synthTensor generates one whole tensor's bf16 bytes, in the chunks (and
// so the random streams) Synth uses, on all cores.
func synthTensor(cfg *Config, s WriteSpec, seed, tensor uint64) []byte {
	buf := make([]byte, s.bytes())
	n := int64(len(buf) / 2)
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for c := int64(0); c*synthChunkElems < n; c++ {
		lo, hi := 2*c*synthChunkElems, 2*min(n, (c+1)*synthChunkElems)
		g.Go(func() error {
			fillSynth(buf[lo:hi], cfg, s.Name, seed, tensor, uint64(c))
			return nil
		})
	}
	g.Wait()
	return buf
}

func writeF32s(w io.Writer, v []float32) error {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	_, err := w.Write(b)
	return err
}

// llama3FreqFactors are the divisors llama3 scaling applies to each
// rotary frequency, as llama.cpp's converter stores them in rope_freqs.
func llama3FreqFactors(cfg *Config) []float32 {
	r := cfg.Rope
	lowWL := float64(r.OriginalMaxPos) / r.LowFreqFactor
	highWL := float64(r.OriginalMaxPos) / r.HighFreqFactor
	ff := make([]float32, cfg.HeadDim/2)
	for i := range ff {
		freq := 1 / math.Pow(r.Theta, float64(2*i)/float64(cfg.HeadDim))
		wavelen := 2 * math.Pi / freq
		switch {
		case wavelen < highWL:
			ff[i] = 1
		case wavelen > lowWL:
			ff[i] = float32(r.Factor)
		default:
			smooth := (float64(r.OriginalMaxPos)/wavelen - r.LowFreqFactor) / (r.HighFreqFactor - r.LowFreqFactor)
			ff[i] = float32(1 / ((1-smooth)/r.Factor + smooth))
		}
	}
	return ff
}

// synthGGUFMetadata is the metadata llama.cpp's converter writes for the
// synthesized model: hyperparameters and the byte-level BPE tokenizer with
// its tokens padded to the vocabulary by reserved ones, as Llama 3's are.
func synthGGUFMetadata(cfg *Config) []gguf.KV {
	a := func(k string) string { return "llama." + k }
	tokens := make([]string, cfg.Vocab)
	types := make([]int64, cfg.Vocab)
	for b := 0; b < 256; b++ {
		tokens[b] = tokenizer.ByteLevel(string([]byte{byte(b)}))
	}
	merges := make([]string, len(synthMerges))
	for i, m := range synthMerges {
		x, y := tokenizer.ByteLevel(m[0]), tokenizer.ByteLevel(m[1])
		merges[i] = x + " " + y
		tokens[256+i] = x + y
	}
	bos, eos := synthSpecialIDs()
	tokens[bos], tokens[eos] = SynthBOS, SynthEOS
	for i := range tokens {
		switch {
		case i == bos || i == eos:
			types[i] = 3 // control
		case i >= synthTokenizerSize:
			tokens[i] = fmt.Sprintf("<|reserved_special_token_%d|>", i-synthTokenizerSize)
			types[i] = 5 // unused
		default:
			types[i] = 1 // normal
		}
	}
	return []gguf.KV{
		{Key: "general.architecture", Value: gguf.String("llama")},
		{Key: "general.name", Value: gguf.String("synth")},
		{Key: "general.file_type", Value: gguf.Uint32(32)}, // bf16
		{Key: a("block_count"), Value: gguf.Uint32(uint32(cfg.NumLayers))},
		{Key: a("context_length"), Value: gguf.Uint32(uint32(cfg.MaxPositions))},
		{Key: a("embedding_length"), Value: gguf.Uint32(uint32(cfg.Hidden))},
		{Key: a("feed_forward_length"), Value: gguf.Uint32(uint32(cfg.Intermediate))},
		{Key: a("attention.head_count"), Value: gguf.Uint32(uint32(cfg.Heads))},
		{Key: a("attention.head_count_kv"), Value: gguf.Uint32(uint32(cfg.KVHeads))},
		{Key: a("attention.key_length"), Value: gguf.Uint32(uint32(cfg.HeadDim))},
		{Key: a("attention.value_length"), Value: gguf.Uint32(uint32(cfg.HeadDim))},
		{Key: a("rope.freq_base"), Value: gguf.Float32(float32(cfg.Rope.Theta))},
		{Key: a("rope.dimension_count"), Value: gguf.Uint32(uint32(cfg.HeadDim))},
		{Key: a("attention.layer_norm_rms_epsilon"), Value: gguf.Float32(float32(cfg.RMSEps))},
		{Key: a("vocab_size"), Value: gguf.Uint32(uint32(cfg.Vocab))},
		{Key: "tokenizer.ggml.model", Value: gguf.String("gpt2")},
		{Key: "tokenizer.ggml.pre", Value: gguf.String("llama-bpe")},
		{Key: "tokenizer.ggml.tokens", Value: gguf.Strings(tokens)},
		{Key: "tokenizer.ggml.token_type", Value: gguf.Ints(gguf.TypeInt32, types)},
		{Key: "tokenizer.ggml.merges", Value: gguf.Strings(merges)},
		{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(uint32(bos))},
		{Key: "tokenizer.ggml.eos_token_id", Value: gguf.Uint32(uint32(eos))},
		{Key: "tokenizer.ggml.add_bos_token", Value: gguf.Bool(true)},
		{Key: "tokenizer.chat_template", Value: gguf.String(synthChatTemplate)},
	}
}
