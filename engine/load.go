// Package engine glues a Hugging Face model directory to a native.Stack and
// runs the decode loop (prefill, sample, stream, stop) over any Stepper: a
// local stack holding the whole model, or a mesh pipeline.
package engine

import (
	"errors"
	"fmt"
	"slices"

	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/model/tokenizer"
	"meshgpu/native"
)

// DefaultMaxContext caps the KV cache length when Options.MaxContext is 0.
const DefaultMaxContext = 4096

// Options select the layers to load and the backend to load them on.
type Options struct {
	Backend native.Backend
	// First..Last are the layers to hold, inclusive; Last -1 = the last layer.
	First, Last int
	// MaxContext bounds every session; 0: min(config max positions, 4096).
	MaxContext int
	// Progress, when set, is called with the bytes copied onto the stack so
	// far and the total for this load: 0 before the first tensor, then after
	// each tensor.
	Progress func(done, total int64)
}

// Model is a loaded layer range of a model on one backend stack.
type Model struct {
	Dir       string
	Config    *model.Config
	Tokenizer *tokenizer.Tokenizer // nil for a stack holding neither embeddings nor head
	Template  *chat.Template       // nil when the model has none
	Stack     native.Stack
	// First..Last are the layers held.
	First, Last int
}

// layerKinds maps per-layer checkpoint names to stack tensor kinds.
var layerKinds = []struct {
	suffix string
	kind   native.TensorKind
	bias   bool
}{
	{model.AttnNorm, native.AttnNorm, false},
	{model.QProj, native.WQ, false},
	{model.KProj, native.WK, false},
	{model.VProj, native.WV, false},
	{model.QBias, native.BQ, true},
	{model.KBias, native.BK, true},
	{model.VBias, native.BV, true},
	{model.OProj, native.WO, false},
	{model.MLPNorm, native.MLPNorm, false},
	{model.GateProj, native.WGate, false},
	{model.UpProj, native.WUp, false},
	{model.DownProj, native.WDown, false},
}

// StackConfig is the native stack config for layers first..last of cfg.
func StackConfig(cfg *model.Config, first, last, maxContext int) (native.StackConfig, error) {
	rope := native.Rope{Theta: float32(cfg.Rope.Theta), FreqFactors: cfg.RopeFreqFactors}
	switch cfg.Rope.Type {
	case "", "default":
		rope.Type = native.RopeDefault
	case "llama3":
		rope.Type = native.RopeLlama3
		rope.Factor = float32(cfg.Rope.Factor)
		rope.LowFreqFactor = float32(cfg.Rope.LowFreqFactor)
		rope.HighFreqFactor = float32(cfg.Rope.HighFreqFactor)
		rope.OrigMaxPos = cfg.Rope.OriginalMaxPos
	default:
		return native.StackConfig{}, fmt.Errorf("rope type %q is not supported (default, llama3)", cfg.Rope.Type)
	}
	if maxContext <= 0 {
		maxContext = DefaultMaxContext
		if cfg.MaxPositions > 0 && cfg.MaxPositions < maxContext {
			maxContext = cfg.MaxPositions
		}
		if cfg.SlidingWindow > 0 && cfg.SlidingWindow < maxContext {
			maxContext = cfg.SlidingWindow
		}
	}
	// Attention always spans the whole cache, which equals a sliding window
	// (Mistral v0.1) only while the context fits in the window.
	if cfg.SlidingWindow > 0 && maxContext > cfg.SlidingWindow {
		return native.StackConfig{}, fmt.Errorf("max context %d exceeds the model's sliding window of %d tokens, which is not supported; use --max-context %d or less",
			maxContext, cfg.SlidingWindow, cfg.SlidingWindow)
	}
	return native.StackConfig{
		Hidden: cfg.Hidden, Intermediate: cfg.Intermediate,
		Heads: cfg.Heads, KVHeads: cfg.KVHeads, HeadDim: cfg.HeadDim,
		Vocab: cfg.Vocab, NumLayers: cfg.NumLayers,
		First: first, Last: last,
		HasEmbed: first == 0, HasHead: last == cfg.NumLayers-1,
		QKVBias:    cfg.AttentionBias,
		MaxContext: maxContext,
		RMSEps:     float32(cfg.RMSEps),
		Rope:       rope,
	}, nil
}

func nativeDType(d model.DType) (native.DType, error) {
	switch d {
	case model.BF16:
		return native.BF16, nil
	case model.F16:
		return native.F16, nil
	case model.F32:
		return native.F32, nil
	case model.Q8_0:
		return native.Q8_0, nil
	case model.Q4_K:
		return native.Q4_K, nil
	case model.Q5_K:
		return native.Q5_K, nil
	case model.Q6_K:
		return native.Q6_K, nil
	}
	return 0, fmt.Errorf("dtype %s is not supported (BF16, F16, F32, Q8_0, Q4_K, Q5_K, Q6_K)", d)
}

// Load reads config, tokenizer and chat template from dir and copies the
// tensors of layers First..Last (plus the embeddings when First is 0, and the
// final norm and LM head when Last is the last layer) into a new stack on
// opts.Backend. Only those tensors' bytes are read.
func Load(dir string, opts Options) (*Model, error) {
	if opts.Backend == nil {
		return nil, errors.New("engine: no backend")
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	first, last := opts.First, opts.Last
	if last == -1 {
		last = cfg.NumLayers - 1
	}
	if first < 0 || first > last || last >= cfg.NumLayers {
		return nil, fmt.Errorf("layers %d-%d are not a range of the model's %d layers (0-%d)", first, last, cfg.NumLayers, cfg.NumLayers-1)
	}
	scfg, err := StackConfig(cfg, first, last, opts.MaxContext)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m := &Model{Dir: dir, Config: cfg, First: first, Last: last}
	ck, err := model.Open(dir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	if scfg.HasEmbed || scfg.HasHead {
		if m.Tokenizer, m.Template, err = LoadTokenizer(dir, ck); err != nil {
			return nil, err
		}
	}
	if err := ck.Check(cfg, first, last, scfg.HasEmbed, scfg.HasHead); err != nil {
		return nil, err
	}
	st, err := opts.Backend.NewStack(scfg)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	if err := setTensors(st, ck, cfg, scfg, opts.Progress); err != nil {
		st.Close()
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	if err := st.Ready(); err != nil {
		st.Close()
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m.Stack = st
	return m, nil
}

// LoadTokenizer reads the tokenizer and chat template (nil when the model
// has none) of a model directory or, when ck is a GGUF file, of its
// metadata. ck may be nil for a directory.
func LoadTokenizer(dir string, ck *model.Checkpoint) (*tokenizer.Tokenizer, *chat.Template, error) {
	var tok *tokenizer.Tokenizer
	var tmpl *chat.Template
	var err error
	if f := ck.GGUF(); f != nil {
		if tok, err = tokenizer.FromGGUF(f); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", dir, err)
		}
		tmpl, err = chat.FromGGUF(f)
	} else {
		if tok, err = tokenizer.Load(dir); err != nil {
			return nil, nil, err
		}
		tmpl, err = chat.Load(dir)
	}
	if errors.Is(err, chat.ErrNoTemplate) {
		return tok, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	return tok, tmpl, nil
}

func setTensors(st native.Stack, ck *model.Checkpoint, cfg *model.Config, scfg native.StackConfig, progress func(done, total int64)) error {
	type entry struct {
		name  string
		kind  native.TensorKind
		layer int
	}
	var todo []entry
	if scfg.HasEmbed {
		todo = append(todo, entry{model.EmbedName, native.TokEmbed, -1})
	}
	for l := scfg.First; l <= scfg.Last; l++ {
		for _, lk := range layerKinds {
			if lk.bias && !cfg.AttentionBias {
				continue
			}
			todo = append(todo, entry{model.LayerTensorName(l, lk.suffix), lk.kind, l})
		}
	}
	if scfg.HasHead {
		todo = append(todo, entry{model.FinalNormName, native.FinalNorm, -1})
		head := model.LMHeadName
		if cfg.TieEmbeddings {
			head = model.EmbedName // the backend keeps one copy when the bytes match
		}
		todo = append(todo, entry{head, native.LMHead, -1})
	}
	// Every tensor is read ahead at once, then copied one at a time, each
	// evicted from the resident set once the backend has it: the peak is
	// the copies plus one tensor.
	var total, done int64
	for _, e := range todo {
		info, err := ck.Info(e.name)
		if err != nil {
			return err
		}
		ck.Prefetch(e.name)
		total += info.Bytes
	}
	if progress != nil {
		progress(0, total) // the pass starts now: a bar starts at 0%, its rate from here
	}
	for _, e := range todo {
		t, err := ck.Tensor(e.name)
		if err != nil {
			return err
		}
		dt, err := nativeDType(t.DType)
		if err != nil {
			return fmt.Errorf("tensor %s: %w", e.name, err)
		}
		if err := st.SetTensor(native.Tensor{Kind: e.kind, Layer: e.layer, DType: dt, Shape: t.Shape, Data: t.Data}); err != nil {
			return fmt.Errorf("tensor %s: %w", e.name, err)
		}
		ck.Evict(e.name)
		done += int64(len(t.Data))
		if progress != nil {
			progress(done, total)
		}
	}
	return nil
}

// Close frees the stack and its sessions.
func (m *Model) Close() error {
	if m.Stack == nil {
		return nil
	}
	err := m.Stack.Close()
	m.Stack = nil
	return err
}

// HasEmbed reports whether the model holds layer 0 and the embeddings.
func (m *Model) HasEmbed() bool { return m.First == 0 }

// HasHead reports whether the model holds the last layer, final norm and LM head.
func (m *Model) HasHead() bool { return m.Last == m.Config.NumLayers-1 }

// EOS is the union of the config's eos_token_id and the tokenizer's EOS ids.
func (m *Model) EOS() []int32 {
	var ids []int32
	for _, id := range m.Config.EOS {
		ids = append(ids, int32(id))
	}
	if m.Tokenizer != nil {
		ids = append(ids, m.Tokenizer.EOS()...)
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}
