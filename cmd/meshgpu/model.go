package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"meshgpu/model"
	"meshgpu/wire"
)

// model inspect|synth: look into a Hugging Face model directory, or write a
// random-weight one in the real layout for tests and benchmarks.
func init() {
	register(&cli.Command{
		Name:  "model",
		Usage: "inspect or synthesize Hugging Face model directories",
		Subcommands: []*cli.Command{
			{
				Name:      "inspect",
				Usage:     "print a model's architecture, sizes per layer and tensors",
				ArgsUsage: "DIR",
				Flags: []cli.Flag{
					&cli.BoolFlag{Name: "json", Usage: "print JSON", EnvVars: cmdEnvVars("inspect", "json")},
					&cli.StringFlag{Name: "layers", Usage: "only the tensors a node holding layers a-b loads, and their bytes", EnvVars: cmdEnvVars("inspect", "layers")},
				},
				Action: inspectAction,
			},
			{
				Name:  "synth",
				Usage: "write a random-weight model directory (bf16) in the Hugging Face Llama layout",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "shape", Required: true, Usage: "model shape: " + strings.Join(model.SynthShapeNames(), ", "), EnvVars: cmdEnvVars("synth", "shape")},
					&cli.StringFlag{Name: "out", Required: true, Usage: "directory to write, or a FILE.gguf to write the model as one GGUF file", EnvVars: cmdEnvVars("synth", "out")},
					&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "random seed; the same seed writes the same bytes", EnvVars: cmdEnvVars("synth", "seed")},
					&cli.IntFlag{Name: "layers", Usage: "number of layers (0: the shape's own)", EnvVars: cmdEnvVars("synth", "layers")},
					&cli.IntFlag{Name: "vocab", Usage: "vocabulary size (0: the shape's own), e.g. a random draft model for a real model's vocabulary", EnvVars: cmdEnvVars("synth", "vocab")},
					&cli.BoolFlag{Name: "force", Usage: "overwrite a model already in --out", EnvVars: cmdEnvVars("synth", "force")},
				},
				Action: synthAction,
			},
			{
				Name:  "quantize",
				Usage: "write a GGUF file's float matrices as ggml's quantized blocks (q8_0, q6_k, q5_k_m, q4_k_m), as llama.cpp's llama-quantize chooses types",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "in", Required: true, Usage: "GGUF file of F32, F16 or BF16 matrices (e.g. from `model synth --out FILE.gguf`)", EnvVars: cmdEnvVars("quantize", "in")},
					&cli.StringFlag{Name: "out", Required: true, Usage: "GGUF file to write", EnvVars: cmdEnvVars("quantize", "out")},
					&cli.StringFlag{Name: "type", Value: "q4_k_m", Usage: "file type: " + strings.Join(model.QuantizeSchemes, ", "), EnvVars: cmdEnvVars("quantize", "type")},
					&cli.BoolFlag{Name: "force", Usage: "overwrite --out", EnvVars: cmdEnvVars("quantize", "force")},
				},
				Action: quantizeAction,
			},
		},
	})
}

func quantizeAction(c *cli.Context) error {
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	next := int64(0)
	err := model.QuantizeGGUF(ctx, c.String("in"), c.String("out"), strings.ToLower(c.String("type")), c.Bool("force"), func(done, total int64) {
		if done >= next || done == total {
			slog.Info("model quantize", "read_bytes", done, "total_bytes", total, "percent", 100*done/max(total, 1))
			next = done + total/10
		}
	})
	if err != nil {
		return fmt.Errorf("model quantize: %w", err)
	}
	st, err := os.Stat(c.String("out"))
	if err != nil {
		return err
	}
	slog.Info("model quantize done", "out", c.String("out"), "type", c.String("type"), "bytes", st.Size(), "seconds", time.Since(start).Seconds())
	return nil
}

type inspectTensor struct {
	Name  string      `json:"name"`
	DType model.DType `json:"dtype"`
	Shape []int       `json:"shape"`
	Bytes int64       `json:"bytes"`
}

// inspectRange is what a node holding layers First..Last loads.
type inspectRange struct {
	First, Last int
	Embeddings  bool  `json:"embeddings"`
	Head        bool  `json:"head"`
	Bytes       int64 `json:"bytes"`
}

type inspectReport struct {
	Dir             string           `json:"dir"`
	Architecture    string           `json:"architecture"`
	ModelType       string           `json:"model_type"`
	Layers          int              `json:"layers"`
	Hidden          int              `json:"hidden"`
	Intermediate    int              `json:"intermediate"`
	Heads           int              `json:"heads"`
	KVHeads         int              `json:"kv_heads"`
	HeadDim         int              `json:"head_dim"`
	Vocab           int              `json:"vocab"`
	RMSEps          float64          `json:"rms_eps"`
	Rope            model.RopeConfig `json:"rope"`
	TiedEmbeddings  bool             `json:"tied_embeddings"`
	AttentionBias   bool             `json:"attention_bias"`
	MaxPositions    int              `json:"max_positions"`
	BOS             int              `json:"bos"`
	EOS             []int            `json:"eos"`
	TorchDType      string           `json:"torch_dtype"`
	DType           model.DType      `json:"dtype"`            // of the layer weights in the checkpoint
	Variant         wire.Variant     `json:"variant,omitzero"` // what a node of these weights registers
	BytesPerLayer   int64            `json:"bytes_per_layer"`
	EmbedBytes      int64            `json:"embed_bytes"`
	HeadBytes       int64            `json:"head_bytes"`
	KVBytesPerToken int64            `json:"kv_bytes_per_token_per_layer"`
	TotalBytes      int64            `json:"total_bytes"`
	Range           *inspectRange    `json:"range,omitempty"`
	Tensors         []inspectTensor  `json:"tensors"`
	Problem         string           `json:"problem,omitempty"`
}

func inspectAction(c *cli.Context) error {
	if c.NArg() != 1 {
		return errors.New("model inspect: give exactly one model directory (meshgpu model inspect DIR)")
	}
	dir := c.Args().First()
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return err
	}
	ck, err := model.Open(dir)
	if err != nil {
		return err
	}
	defer ck.Close()
	r := inspectReport{
		Dir: dir, Architecture: cfg.Architecture, ModelType: cfg.ModelType, Layers: cfg.NumLayers,
		Hidden: cfg.Hidden, Intermediate: cfg.Intermediate, Heads: cfg.Heads, KVHeads: cfg.KVHeads,
		HeadDim: cfg.HeadDim, Vocab: cfg.Vocab, RMSEps: cfg.RMSEps, Rope: cfg.Rope,
		TiedEmbeddings: cfg.TieEmbeddings, AttentionBias: cfg.AttentionBias, MaxPositions: cfg.MaxPositions,
		BOS: cfg.BOS, EOS: cfg.EOS, TorchDType: cfg.TorchDType,
	}
	// Without --layers: every tensor. With it: what that node loads.
	first, last, embed, head := 0, cfg.NumLayers-1, true, true
	names := ck.Names()
	if s := c.String("layers"); s != "" {
		if first, last, err = model.ParseLayers(s, cfg.NumLayers); err != nil {
			return fmt.Errorf("--layers: %w", err)
		}
		embed, head = first == 0, last == cfg.NumLayers-1
		r.Range = &inspectRange{First: first, Last: last, Embeddings: embed, Head: head}
		names = nil
		for _, spec := range cfg.Tensors(first, last, embed, head) {
			names = append(names, spec.Name)
		}
	}
	for _, name := range names {
		t, err := ck.Info(name) // metadata only: inspecting reads no weights
		if err != nil {
			return err
		}
		n := t.Bytes
		r.Tensors = append(r.Tensors, inspectTensor{name, t.DType, t.Shape, n})
		r.TotalBytes += n
	}
	if r.Range != nil {
		r.Range.Bytes = r.TotalBytes
	}
	// The checkpoint's dtype is that of the first layer's attention weight;
	// sizes are quoted in it.
	r.DType = model.BF16
	if t, err := ck.Info(model.LayerTensorName(0, model.QProj)); err == nil && t.DType.IsFloat() {
		r.DType = t.DType
	}
	r.BytesPerLayer, r.EmbedBytes, r.HeadBytes = cfg.LayerBytes(r.DType), cfg.EmbedBytes(r.DType), cfg.HeadBytes(r.DType)
	r.KVBytesPerToken = cfg.KVBytesPerToken(r.DType)
	if v, err := model.VariantOf(ck, cfg, ""); err == nil {
		r.Variant = wire.Variant{Label: v.Label, Fingerprint: v.Fingerprint}
	}
	checkErr := ck.Check(cfg, first, last, embed, head)
	if checkErr != nil {
		r.Problem = checkErr.Error()
	}

	out := c.App.Writer
	if c.Bool("json") {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			return err
		}
	} else {
		printInspect(out, &r)
	}
	if checkErr != nil {
		return fmt.Errorf("checkpoint does not match config.json: %w", checkErr)
	}
	return nil
}

func printInspect(out io.Writer, r *inspectReport) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	rope := r.Rope.Type + fmt.Sprintf(" theta=%g", r.Rope.Theta)
	if r.Rope.Type == "llama3" {
		rope += fmt.Sprintf(" factor=%g low=%g high=%g original_max_pos=%d",
			r.Rope.Factor, r.Rope.LowFreqFactor, r.Rope.HighFreqFactor, r.Rope.OriginalMaxPos)
	}
	rows := [][2]string{
		{"architecture", fmt.Sprintf("%s (%s)", r.Architecture, r.ModelType)},
		{"layers", fmt.Sprint(r.Layers)},
		{"hidden", fmt.Sprint(r.Hidden)},
		{"intermediate", fmt.Sprint(r.Intermediate)},
		{"heads", fmt.Sprintf("%d (kv %d, head_dim %d)", r.Heads, r.KVHeads, r.HeadDim)},
		{"vocab", fmt.Sprint(r.Vocab)},
		{"rms_eps", fmt.Sprint(r.RMSEps)},
		{"rope", rope},
		{"embeddings", map[bool]string{true: "tied", false: "untied"}[r.TiedEmbeddings]},
		{"qkv bias", fmt.Sprint(r.AttentionBias)},
		{"max positions", fmt.Sprint(r.MaxPositions)},
		{"bos / eos", fmt.Sprintf("%d / %v", r.BOS, r.EOS)},
		{"dtype", fmt.Sprintf("%s (config: %s)", r.DType, r.TorchDType)},
		{"variant", r.Variant.Label + " " + r.Variant.Fingerprint},
		{"bytes per layer", humanBytes(r.BytesPerLayer)},
		{"embed bytes", humanBytes(r.EmbedBytes)},
		{"head bytes", humanBytes(r.HeadBytes)},
		{"kv bytes/token/layer", humanBytes(r.KVBytesPerToken)},
		{"total bytes", humanBytes(r.TotalBytes)},
	}
	if r.Range != nil {
		rows[len(rows)-1] = [2]string{fmt.Sprintf("layers %d-%d bytes", r.Range.First, r.Range.Last),
			fmt.Sprintf("%s (embeddings: %v, final norm + head: %v)", humanBytes(r.Range.Bytes), r.Range.Embeddings, r.Range.Head)}
	}
	for _, row := range rows {
		fmt.Fprintf(w, "%s\t%s\n", row[0], row[1])
	}
	w.Flush()
	fmt.Fprintf(out, "\n%d tensors:\n", len(r.Tensors))
	for _, t := range r.Tensors {
		fmt.Fprintf(w, "%s\t%s\t%v\n", t.Name, t.DType, t.Shape)
	}
	w.Flush()
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%d (%.2f GiB)", n, float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%d (%.2f MiB)", n, float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%d (%.2f KiB)", n, float64(n)/(1<<10))
	}
	return fmt.Sprint(n)
}

func synthAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("model synth takes no arguments, got %q (use --out DIR)", c.Args().First())
	}
	if c.Int("layers") < 0 || c.Int("vocab") < 0 {
		return fmt.Errorf("--layers and --vocab must be >= 0, got %d and %d", c.Int("layers"), c.Int("vocab"))
	}
	// Ctrl-C stops the write and removes the partial file.
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	opts := model.SynthOptions{
		Shape: c.String("shape"), Layers: c.Int("layers"), Vocab: c.Int("vocab"), Seed: c.Uint64("seed"), Force: c.Bool("force"),
	}
	var bar *progressbar.ProgressBar
	if term.IsTerminal(int(os.Stderr.Fd())) {
		opts.Progress = func(done, total int64) {
			if bar == nil {
				bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(os.Stderr),
					progressbar.OptionShowBytes(true), progressbar.OptionSetDescription(filepath.Base(c.String("out"))),
					progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionSetWidth(30))
			}
			bar.Set64(done)
		}
	} else {
		next := int64(0)
		opts.Progress = func(done, total int64) {
			if done >= next || done == total {
				slog.Info("model synth", "written_bytes", done, "total_bytes", total, "percent", 100*done/total)
				next = done + total/10
			}
		}
	}
	start := time.Now()
	synth := model.Synth
	if strings.EqualFold(filepath.Ext(c.String("out")), ".gguf") {
		synth = model.SynthGGUF
	}
	cfg, err := synth(ctx, c.String("out"), opts)
	if bar != nil {
		bar.Finish()
		fmt.Fprintln(os.Stderr)
	}
	if err != nil {
		return fmt.Errorf("model synth: %w", err)
	}
	slog.Info("model synth done", "dir", c.String("out"), "shape", opts.Shape, "layers", cfg.NumLayers,
		"bytes", cfg.TotalBytes(model.BF16),
		"seconds", time.Since(start).Seconds())
	return nil
}
