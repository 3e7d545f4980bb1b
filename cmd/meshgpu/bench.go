package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"

	"meshgpu/bench"
	"meshgpu/native"
)

// bench SUITE: the latency suites (package bench). Each prints a table,
// and writes JSON (--json) and a chart (--plot) when asked.
func init() {
	suites := []struct{ name, usage string }{
		{"kernels", "per-op timing at a layer's shapes (--synth SHAPE) vs memory bandwidth"},
		{"layers", "one decode step through 1, 4, 16, 32 layers vs the bandwidth floor"},
		{"decode", "end-to-end decode tok/s and weight GB/s vs memory bandwidth (+ PyTorch rows on a GPU host)"},
		{"prefill", "time to prefill a --prompt-tokens prompt (default 512) in one forward call, tok/s (llama-bench's pp512)"},
		{"hops", "added latency per hop: raw-tcp, direct, relay-rpc, relay-tunnel, direct-tls"},
		{"mesh", "--nodes local nodes (--relay: the last through a relay; --rtt: emulated links): per-token compute, hop and relay time; --speculate MODE: plain vs speculative tok/s"},
		{"streams", "one node with the whole model: 1 stream vs --streams concurrent streams through its OpenAI API, aggregate tok/s and the ratio"},
		{"memory", "resident memory of a node's layer range (--layers) against the stored bytes of its tensors plus one session's KV"},
		{"perplexity", "quality as llama.cpp's llama-perplexity measures it: --model's perplexity of --file in --ctx-token chunks; --kl-base: mean KL divergence and same top token against an f32 base"},
	}
	var subs []*cli.Command
	for _, s := range suites {
		subs = append(subs, &cli.Command{Name: s.name, Usage: s.usage, Flags: suiteFlags(s.name), Action: benchAction})
	}
	register(&cli.Command{
		Name:      "bench",
		Usage:     "latency suites: kernels, layers, decode, prefill, hops, mesh, streams; quality: perplexity",
		ArgsUsage: "SUITE [flags]",
		Description: "Each suite prints a table, writes JSON (--json FILE) and a chart (--plot FILE.svg|.png),\n" +
			"and measures its baseline in the same run (memory bandwidth, raw loopback TCP, one-node decode, one stream);\n" +
			"perplexity scores --model on --file as llama.cpp's llama-perplexity does (no chart; --kl-base: an f32 reference).",
		Subcommands:     subs,
		HideHelpCommand: true,
		Action: func(c *cli.Context) error {
			if c.NArg() == 0 {
				return fmt.Errorf("bench takes one suite: %s", strings.Join(benchSuites, ", "))
			}
			return fmt.Errorf("unknown suite %q: want one of %s", c.Args().First(), strings.Join(benchSuites, ", "))
		},
	})
}

// benchFlags are every suite's flags (each subcommand needs its own values).
func benchFlags() []cli.Flag {
	return append([]cli.Flag{
		&cli.StringFlag{Name: "backend", Value: "auto", Usage: "cpu, cuda or auto", EnvVars: envVars("backend")},
		&cli.StringFlag{Name: "cuda-lib", Usage: "path of libmeshgpu_cuda.so", EnvVars: envVars("cuda-lib")},
		&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)", EnvVars: envVars("threads")},
		&cli.StringFlag{Name: "model", Usage: "Hugging Face model directory (layers, decode, mesh, streams, perplexity; mesh default: ../shared/models/gocoder-6m when present)", EnvVars: envVars("model")},
		&cli.StringFlag{Name: "synth", Usage: "synthesize a random-weight model SHAPE[:LAYERS] instead of --model (tiny, llama-3.2-1b, llama-3.1-8b); kernels: the shape timed", EnvVars: cmdEnvVars("bench", "synth")},
		&cli.StringFlag{Name: "cache-dir", Usage: "where synthesized models are kept (default: the user cache dir's meshgpu/synth)", EnvVars: cmdEnvVars("bench", "cache-dir")},
		&cli.IntFlag{Name: "n", Usage: "iterations: hops per series, timed calls per op, tokens (0: the suite's default)", EnvVars: cmdEnvVars("bench", "n")},
		&cli.StringFlag{Name: "json", Usage: "write the report as JSON to this file", EnvVars: cmdEnvVars("bench", "json")},
		&cli.StringFlag{Name: "plot", Usage: "write a chart to this file (.svg, .png or .pdf)", EnvVars: cmdEnvVars("bench", "plot")},
		&cli.BoolFlag{Name: "wide", Usage: "print the table in one piece however wide (default: cut into pieces of at most 100 columns)", EnvVars: cmdEnvVars("bench", "wide")},
		&cli.IntFlag{Name: "nodes", Value: 3, Usage: "mesh: nodes to start", EnvVars: cmdEnvVars("bench", "nodes")},
		&cli.BoolFlag{Name: "relay", Usage: "mesh: reach the last node through a relay (also measures the mesh without it)", EnvVars: cmdEnvVars("bench", "relay")},
		&cli.StringFlag{Name: "hop-dtype", Value: "bf16", Usage: "mesh: activation dtype on hops, bf16 or f32", EnvVars: cmdEnvVars("bench", "hop-dtype")},
		&cli.IntSliceFlag{Name: "payload-kib", Value: cli.NewIntSlice(4, 8), Usage: "hops: bf16 payload sizes in KiB", EnvVars: cmdEnvVars("bench", "payload-kib")},
		&cli.DurationFlag{Name: "rtt", Usage: "hops, mesh: emulate a network round-trip time on every connection (mesh: every connection a node dials, the tail's to the head included; e.g. 20ms; 0: plain loopback)", EnvVars: cmdEnvVars("bench", "rtt")},
		&cli.StringFlag{Name: "speculate", Value: "off", Usage: "mesh: also time speculative decoding (ngram or draft) against plain decoding on the same head, over Go-code prompts", EnvVars: cmdEnvVars("bench", "speculate")},
		&cli.StringFlag{Name: "prompts", Usage: "mesh: a JSON file holding a list of prompt strings for the prompt comparison (default: built-in Go-code prompts); plain decoding with chain replies against direct replies, and --speculate", EnvVars: cmdEnvVars("bench", "prompts")},
		&cli.IntFlag{Name: "speculate-inflight", Usage: "mesh --speculate: most verify passes in flight per stream on the head (0: the node's default); a second head in the same run sends one pass at a time", EnvVars: cmdEnvVars("bench", "speculate-inflight")},
		&cli.StringFlag{Name: "draft-model", Usage: "mesh --speculate draft: the draft model directory (default: a random model with the target's vocabulary, the always-wrong worst case)", EnvVars: cmdEnvVars("bench", "draft-model")},
		&cli.BoolFlag{Name: "tls", Usage: "hops: serve the node and relay over TLS (https, wss), as a relay on the internet is reached", EnvVars: cmdEnvVars("bench", "tls")},
		&cli.IntSliceFlag{Name: "depths", Value: cli.NewIntSlice(1, 4, 16, 32), Usage: "layers: layer counts to time", EnvVars: cmdEnvVars("bench", "depths")},
		&cli.IntSliceFlag{Name: "contexts", Value: cli.NewIntSlice(128, 512, 2048), Usage: "kernels: attention context lengths", EnvVars: cmdEnvVars("bench", "contexts")},
		&cli.IntFlag{Name: "prompt-tokens", Value: 16, Usage: "decode, mesh, streams: prompt length; prefill: the prompt timed (default 512); layers: tokens already cached", EnvVars: cmdEnvVars("bench", "prompt-tokens")},
		&cli.IntFlag{Name: "streams", Value: 8, Usage: "streams: concurrent streams timed against one (2 to 64)", EnvVars: cmdEnvVars("bench", "streams")},
		&cli.IntFlag{Name: "rounds", Value: 1, Usage: "streams: alternate 1 and --streams streams this many times, each side's best counts (1 to 100)", EnvVars: cmdEnvVars("bench", "rounds")},
		&cli.IntFlag{Name: "max-batch", Value: 8, Usage: "streams: the node's --max-batch (most sessions in one forward call; 0: each step alone)", EnvVars: cmdEnvVars("bench", "max-batch")},
		&cli.StringFlag{Name: "layers", Usage: "memory: the layer range a node would serve (a-b; default all)", EnvVars: cmdEnvVars("bench", "layers")},
		&cli.IntFlag{Name: "max-context", Usage: "memory: KV capacity of the one session (0: 4096)", EnvVars: cmdEnvVars("bench", "max-context")},
		&cli.IntFlag{Name: "prefill", Usage: "memory: also measure after one prompt of this many tokens (at most --max-context; all layers), so its KV pages are resident", EnvVars: cmdEnvVars("bench", "prefill")},
		&cli.StringFlag{Name: "file", Usage: "perplexity: the text to score (tokenized whole)", EnvVars: cmdEnvVars("bench", "file")},
		&cli.IntFlag{Name: "ctx", Value: 128, Usage: "perplexity: chunk length in tokens (even, at least 4); the second half of each chunk is scored", EnvVars: cmdEnvVars("bench", "ctx")},
		&cli.StringFlag{Name: "kl-base", Usage: "perplexity: a model with the same tokenizer, computed in f32 on the CPU backend, to compare next-token distributions with", EnvVars: cmdEnvVars("bench", "kl-base")},
	}, backendFlags()...)
}

var benchSuites = []string{"kernels", "layers", "decode", "prefill", "hops", "mesh", "streams", "memory", "perplexity"}

// suiteOwnFlags are the flags each suite reads besides the output and
// backend flags, so `bench SUITE --help` lists only what applies.
var suiteOwnFlags = map[string][]string{
	"kernels":    {"synth", "cache-dir", "n", "contexts"},
	"layers":     {"model", "synth", "cache-dir", "n", "depths", "prompt-tokens"},
	"decode":     {"model", "synth", "cache-dir", "n", "prompt-tokens"},
	"prefill":    {"model", "synth", "cache-dir", "n", "prompt-tokens"},
	"hops":       {"n", "payload-kib", "rtt", "tls"},
	"mesh":       {"model", "synth", "cache-dir", "n", "nodes", "relay", "hop-dtype", "rtt", "speculate", "speculate-inflight", "draft-model", "prompt-tokens", "prompts"},
	"streams":    {"model", "synth", "cache-dir", "n", "streams", "rounds", "max-batch", "prompt-tokens"},
	"memory":     {"model", "synth", "cache-dir", "layers", "max-context", "prefill"},
	"perplexity": {"model", "synth", "cache-dir", "file", "ctx", "kl-base"},
}

// suiteHiddenFlags are taken but not listed, so that a common mistake gets
// the suite's own explanation instead of "flag provided but not defined".
var suiteHiddenFlags = map[string][]string{"kernels": {"model"}, "perplexity": {"plot"}}

// suiteFlags is benchFlags cut to one suite's: its own, the output flags
// (no chart for perplexity) and the backend's (none for hops, which
// times the network).
func suiteFlags(suite string) []cli.Flag {
	keep := map[string]bool{"json": true, "plot": suite != "perplexity", "wide": true}
	hidden := map[string]bool{}
	for _, n := range suiteHiddenFlags[suite] {
		keep[n], hidden[n] = true, true
	}
	for _, n := range suiteOwnFlags[suite] {
		keep[n] = true
	}
	if suite != "hops" {
		for _, n := range backendGroup {
			keep[n] = true
		}
	}
	var out []cli.Flag
	for _, f := range benchFlags() {
		if keep[f.Names()[0]] {
			if sf, ok := f.(*cli.StringFlag); ok && hidden[sf.Name] {
				sf.Hidden = true
			}
			out = append(out, f)
		}
	}
	return out
}

// has reports whether the running suite has flag name.
func has(c *cli.Context, name string) bool {
	for _, f := range c.Command.Flags {
		if f.Names()[0] == name {
			return true
		}
	}
	return false
}

func benchAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("bench %s takes no arguments, got %q", c.Command.Name, c.Args().First())
	}
	suite := c.Command.Name
	if plot := c.String("plot"); plot != "" {
		switch strings.ToLower(filepath.Ext(plot)) {
		case ".svg", ".png", ".pdf":
		default:
			return fmt.Errorf("--plot %s: use a .svg, .png or .pdf file name", plot)
		}
	}
	if c.Int("n") < 0 || c.Int("n") > 1_000_000 {
		return fmt.Errorf("--n %d: want 0 (the suite's default) to 1000000", c.Int("n"))
	}
	if c.Int("threads") < 0 || has(c, "prompt-tokens") && (c.Int("prompt-tokens") < 1 || c.Int("prompt-tokens") > 1<<16) {
		return errors.New("--threads must not be negative; --prompt-tokens must be 1 to 65536")
	}
	if c.String("model") != "" && c.String("synth") != "" {
		return errors.New("--model and --synth both given: pick one")
	}
	var cs native.CUDASettings
	var err error
	if has(c, "cuda-attention") { // hops opens no backend
		if cs, err = cudaSettings(c); err != nil {
			return err
		}
	}
	be := bench.BackendConfig{Name: c.String("backend"), CUDALib: c.String("cuda-lib"), Threads: c.Int("threads"), CUDA: cs, CPUISA: c.String("cpu-isa")}
	src := bench.ModelSource{Dir: c.String("model"), Synth: c.String("synth"), CacheDir: c.String("cache-dir")}
	if src.Synth != "" {
		if _, _, err := bench.ParseSynth(src.Synth); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var rep *bench.Report
	writeJSON := func(w io.Writer) error { return rep.WriteJSON(w) } // a suite whose JSON holds more replaces it
	switch suite {
	case "kernels":
		shape := ""
		if src.Dir != "" {
			return errors.New("bench kernels times a synthesized shape's layer: use --synth SHAPE, not --model")
		}
		if src.Synth != "" {
			shape, _, _ = bench.ParseSynth(src.Synth)
		}
		rep, err = bench.Kernels(ctx, bench.KernelsConfig{Backend: be, Shape: shape, N: c.Int("n"), Contexts: c.IntSlice("contexts")})
	case "layers":
		rep, err = bench.Layers(ctx, bench.LayersConfig{Backend: be, Model: src, Depths: c.IntSlice("depths"), N: c.Int("n"), Context: c.Int("prompt-tokens")})
	case "decode":
		rep, err = bench.Decode(ctx, bench.DecodeConfig{Backend: be, Model: src, N: c.Int("n"), PromptTokens: c.Int("prompt-tokens")})
	case "prefill":
		pt := c.Int("prompt-tokens")
		if !c.IsSet("prompt-tokens") {
			pt = 512 // the flag's default (16) is the decode suites' prompt
		}
		rep, err = bench.Prefill(ctx, bench.PrefillConfig{Backend: be, Model: src, N: c.Int("n"), PromptTokens: pt})
	case "hops":
		rep, err = bench.Hops(ctx, bench.HopsConfig{N: c.Int("n"), PayloadKiB: c.IntSlice("payload-kib"),
			RTT: c.Duration("rtt"), TLS: c.Bool("tls"), Logger: benchLogger()})
	case "mesh":
		if src.Dir == "" && src.Synth == "" {
			src.Dir = defaultMeshModel()
		}
		var prompts []string
		if f := c.String("prompts"); f != "" {
			if prompts, err = bench.ReadPrompts(f); err != nil {
				return fmt.Errorf("--prompts: %w", err)
			}
		}
		var mr *bench.MeshReport
		mr, err = bench.Mesh(ctx, bench.MeshConfig{Prompts: prompts, Backend: be, Model: src, Nodes: c.Int("nodes"), Relay: c.Bool("relay"),
			N: c.Int("n"), PromptTokens: c.Int("prompt-tokens"), HopDType: strings.ToLower(c.String("hop-dtype")),
			RTT: c.Duration("rtt"), Speculate: strings.ToLower(c.String("speculate")), DraftModel: bench.ModelSource{Dir: c.String("draft-model")},
			SpeculateInFlight: c.Int("speculate-inflight"), Logger: benchLogger()})
		if mr != nil {
			rep = mr.Report
		}
	case "streams":
		if c.Int("streams") < 2 || c.Int("streams") > 64 || c.Int("rounds") < 1 || c.Int("rounds") > 100 || c.Int("max-batch") < 0 {
			return errors.New("--streams must be 2 to 64, --rounds 1 to 100, --max-batch not negative (0: each step alone)")
		}
		rep, err = bench.Streams(ctx, bench.StreamsConfig{Backend: be, Model: src, Streams: c.Int("streams"), N: c.Int("n"),
			PromptTokens: c.Int("prompt-tokens"), MaxBatch: batchFlag(c.Int("max-batch")), Rounds: c.Int("rounds"), Logger: benchLogger()})
	case "memory":
		rep, err = bench.Memory(ctx, bench.MemoryConfig{Backend: be, Model: src, Layers: c.String("layers"), MaxContext: c.Int("max-context"), Prefill: c.Int("prefill")})
	case "perplexity":
		if c.String("plot") != "" {
			return errors.New("--plot: bench perplexity draws no chart; its numbers are in the table and --json")
		}
		var pr *bench.PerplexityReport
		pr, err = bench.Perplexity(ctx, bench.PerplexityConfig{Backend: be, Model: src, Base: bench.ModelSource{Dir: c.String("kl-base")},
			File: c.String("file"), Ctx: c.Int("ctx")})
		if pr != nil {
			rep, writeJSON = pr.Report, pr.WriteJSON
		}
	default:
		return fmt.Errorf("unknown suite %q: want one of %s", suite, strings.Join(benchSuites, ", "))
	}
	if err != nil {
		return fmt.Errorf("bench %s: %w", suite, err)
	}
	width := tableWidth
	if c.Bool("wide") {
		width = 0
	}
	if err := rep.WriteTableWidth(c.App.Writer, width); err != nil {
		return err
	}
	if path := c.String("json"); path != "" {
		if err := writeFileWith(path, writeJSON); err != nil {
			return fmt.Errorf("--json: %w", err)
		}
	}
	if path := c.String("plot"); path != "" {
		if err := rep.Plot(path); err != nil {
			return fmt.Errorf("--plot: %w", err)
		}
	}
	return nil
}

// tableWidth is the widest a bench table is printed without --wide.
const tableWidth = 100

// defaultMeshModel is the test model beside the checkout when it is there;
// "" lets the suite synthesize a tiny one.
func defaultMeshModel() string {
	p := filepath.Join("..", "shared", "models", "gocoder-6m")
	if _, err := os.Stat(filepath.Join(p, "config.json")); err == nil {
		return p
	}
	return ""
}

// writeFileWith writes a file through a temporary one, so a failed run
// never leaves half a report where the last good one was.
func writeFileWith(path string, write func(w io.Writer) error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".bench-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := write(tmp); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// benchLogger is the logger of the servers a suite starts: their routine
// info lines (peer registered, connection closed) would bury the table, so
// only warnings and errors pass unless --log-level debug asked for all.
func benchLogger() *slog.Logger {
	h := slog.Default().Handler()
	if h.Enabled(context.Background(), slog.LevelDebug) {
		return slog.Default()
	}
	return slog.New(minLevel{h, slog.LevelWarn})
}

type minLevel struct {
	slog.Handler
	min slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.Handler.Enabled(ctx, l)
}

func (m minLevel) WithAttrs(a []slog.Attr) slog.Handler {
	return minLevel{m.Handler.WithAttrs(a), m.min}
}
func (m minLevel) WithGroup(g string) slog.Handler { return minLevel{m.Handler.WithGroup(g), m.min} }
