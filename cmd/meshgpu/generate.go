package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/engine"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/sched"
)

// generate: run a model on one machine and stream its continuation of a
// prompt. With --layers covering part of the model it loads that range and
// the rest as separate stacks and hands activations between them in
// --hop-dtype, as a mesh would (a local check of split execution).
func init() {
	register(&cli.Command{
		Name:  "generate",
		Usage: "generate text from a prompt on this machine",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "model", Required: true, Usage: "Hugging Face model directory or .gguf file; or from the hub: a repository id org/name, or a GGUF as org/name:Q4_K_M or org/name/file.gguf (HF_TOKEN for gated ones)", EnvVars: envVars("model")},
			&cli.StringFlag{Name: "prompt", Required: true, Usage: "prompt text", EnvVars: cmdEnvVars("generate", "prompt")},
			&cli.IntFlag{Name: "n", Aliases: []string{"max-tokens"}, Value: 64, Usage: "tokens to generate at most", EnvVars: cmdEnvVars("generate", "max-tokens")},
			&cli.Float64Flag{Name: "temperature", Value: 0, Usage: "sampling temperature (0: greedy)", EnvVars: cmdEnvVars("generate", "temperature")},
			&cli.IntFlag{Name: "top-k", Usage: "keep the k most likely tokens (0: off)", EnvVars: cmdEnvVars("generate", "top-k")},
			&cli.Float64Flag{Name: "top-p", Usage: "nucleus sampling mass (0 or 1: off)", EnvVars: cmdEnvVars("generate", "top-p")},
			&cli.Float64Flag{Name: "min-p", Usage: "drop tokens below min-p times the top probability (0: off)", EnvVars: cmdEnvVars("generate", "min-p")},
			&cli.Float64Flag{Name: "repetition-penalty", Usage: "HF repetition penalty (0 or 1: off)", EnvVars: cmdEnvVars("generate", "repetition-penalty")},
			&cli.Uint64Flag{Name: "seed", Usage: "sampling seed", EnvVars: cmdEnvVars("generate", "seed")},
			&cli.StringSliceFlag{Name: "stop", Usage: "stop before this string (repeatable)", EnvVars: cmdEnvVars("generate", "stop")},
			&cli.BoolFlag{Name: "ignore-eos", Usage: "keep generating after the end-of-sequence token", EnvVars: cmdEnvVars("generate", "ignore-eos")},
			&cli.BoolFlag{Name: "chat", Usage: "wrap the prompt as a user message in the model's chat template", EnvVars: cmdEnvVars("generate", "chat")},
			&cli.StringFlag{Name: "backend", Value: "auto", Usage: "cpu, cuda or auto", EnvVars: envVars("backend")},
			&cli.StringFlag{Name: "cuda-lib", Usage: "path of libmeshgpu_cuda.so", EnvVars: envVars("cuda-lib")},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)", EnvVars: envVars("threads")},
			&cli.StringFlag{Name: "layers", Usage: "run this layer range (e.g. 0-2) and the rest as separate stacks, handing activations over in --hop-dtype (default: one stack)", EnvVars: cmdEnvVars("generate", "layers")},
			&cli.StringFlag{Name: "hop-dtype", Value: "bf16", Usage: "activation dtype between stacks with --layers: bf16 or f32", EnvVars: cmdEnvVars("generate", "hop-dtype")},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object with ids, text and timings instead of streaming", EnvVars: cmdEnvVars("generate", "json")},
		}, backendFlags()...),
		Action: generateAction,
	})
}

type generateJSON struct {
	PromptIDs    []int32 `json:"prompt_ids"`
	IDs          []int32 `json:"ids"`
	Text         string  `json:"text"`
	FinishReason string  `json:"finish_reason"`
	Backend      string  `json:"backend"`
	Timings      struct {
		PrefillMS       float64 `json:"prefill_ms"`
		DecodeMS        float64 `json:"decode_ms"`
		DecodeTokPerSec float64 `json:"decode_tok_per_s"`
	} `json:"timings"`
}

func generateAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("generate takes no arguments, got %q (quote the prompt: --prompt \"...\")", c.Args().First())
	}
	p := engine.GenerateParams{
		MaxTokens: c.Int("n"),
		Stop:      c.StringSlice("stop"),
		IgnoreEOS: c.Bool("ignore-eos"),
		Sampling: sample.Params{
			Temperature: c.Float64("temperature"), TopK: c.Int("top-k"), TopP: c.Float64("top-p"),
			MinP: c.Float64("min-p"), RepetitionPenalty: c.Float64("repetition-penalty"), Seed: c.Uint64("seed"),
		},
	}
	if err := p.Validate(); err != nil {
		return err
	}
	beOpts, err := backendOptions(c)
	if err != nil {
		return err
	}
	hop, err := native.ParseDType(c.String("hop-dtype"))
	if err != nil || hop == native.F16 {
		return fmt.Errorf("--hop-dtype must be bf16 or f32, not %q", c.String("hop-dtype"))
	}
	dir, err := modelDir(c.Context, c.String("model"), "")
	if err != nil {
		return err
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return err
	}
	first, last := 0, cfg.NumLayers-1
	if s := c.String("layers"); s != "" {
		if first, last, err = model.ParseLayers(s, cfg.NumLayers); err != nil {
			return fmt.Errorf("--layers: %w", err)
		}
	}

	be, err := native.Open(c.String("backend"), beOpts)
	if err != nil {
		return err
	}
	defer be.Close()
	slog.Debug("backend", "name", be.Name(), "device", be.Describe())

	var stages []*engine.Model
	defer func() {
		for _, m := range stages {
			m.Close()
		}
	}()
	prog := newProgress("loading " + filepath.Base(filepath.Clean(dir)))
	for _, r := range engine.SplitRanges(first, last, cfg.NumLayers) {
		m, err := engine.Load(dir, engine.Options{Backend: be, First: r[0], Last: r[1], Progress: prog.Update})
		if err != nil {
			prog.Finish()
			return err
		}
		stages = append(stages, m)
	}
	prog.Finish()
	head, tail := stages[0], stages[len(stages)-1]

	var prompt []int32
	if c.Bool("chat") {
		if head.Template == nil {
			return fmt.Errorf("--chat: %w", chat.ErrNoTemplate)
		}
		text, err := head.Template.Render([]chat.Message{{Role: "user", Content: c.String("prompt")}}, true)
		if err != nil {
			return fmt.Errorf("--chat: %w", err)
		}
		prompt = head.Tokenizer.Encode(text, false) // the template writes the special tokens
	} else {
		prompt = head.Tokenizer.Encode(c.String("prompt"), true)
	}
	if len(prompt) == 0 {
		return errors.New("--prompt is empty after tokenization")
	}
	maxCtx := head.Stack.Config().MaxContext
	if len(prompt)+p.MaxTokens > maxCtx {
		return fmt.Errorf("prompt of %d tokens + -n %d exceeds the context of %d tokens; lower -n", len(prompt), p.MaxTokens, maxCtx)
	}

	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt)
	defer stop()
	if len(stages) == 1 {
		hop = native.F32 // one stack: nothing crosses a wire
	}
	// Each stage's layers run through its stack's scheduler, as a node's do.
	links := make([]sched.Link, len(stages))
	for i, m := range stages {
		sess, err := m.Stack.NewSession(len(prompt) + p.MaxTokens)
		if err != nil {
			return err
		}
		defer sess.Close()
		sc, err := sched.New(m.Stack, m.First, m.Last, sched.Config{DType: hop})
		if err != nil {
			return err
		}
		defer sc.Close()
		links[i] = sched.Link{Sched: sc, Session: sess}
	}
	step := sched.ChainStepper(links, hop, p.Sampling)

	out := c.App.Writer
	jsonOut := c.Bool("json")
	var onToken func(engine.Token) error
	if !jsonOut {
		onToken = func(t engine.Token) error {
			_, err := io.WriteString(out, t.Text)
			return err
		}
	}
	res, err := engine.Decode(ctx, head.Tokenizer, tail.EOS(), prompt, p, step, onToken)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			return errors.New("interrupted")
		}
		return err
	}
	tps := 0.0
	if res.DecodeTime > 0 && res.CompletionTokens > 1 {
		tps = float64(res.CompletionTokens-1) / res.DecodeTime.Seconds()
	}
	if !jsonOut {
		if _, err := io.WriteString(out, "\n"); err != nil {
			return err
		}
	}
	slog.Info("generated", "prompt_tokens", res.PromptTokens, "tokens", res.CompletionTokens, "finish", res.FinishReason,
		"prefill", res.PrefillTime.Round(time.Microsecond), "decode_tok_per_s", fmt.Sprintf("%.1f", tps), "backend", be.Describe(),
		"stacks", len(stages))
	if !jsonOut {
		return nil
	}
	j := generateJSON{PromptIDs: prompt, IDs: res.IDs, Text: res.Text, FinishReason: res.FinishReason, Backend: be.Describe()}
	if j.IDs == nil {
		j.IDs = []int32{}
	}
	j.Timings.PrefillMS = float64(res.PrefillTime.Microseconds()) / 1000
	j.Timings.DecodeMS = float64(res.DecodeTime.Microseconds()) / 1000
	j.Timings.DecodeTokPerSec = tps
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(j)
}
