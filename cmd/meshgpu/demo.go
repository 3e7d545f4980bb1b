package main

import (
	"fmt"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/urfave/cli/v2"

	"meshgpu/demo"
)

func init() {
	register(&cli.Command{
		Name:  "demo",
		Usage: "start a relay, a tracker and three nodes on 127.0.0.1, stream one answer, and serve the OpenAI API until Ctrl-C",
		Description: "The model is --model (also $MESHGPU_MODEL), else ../shared/models/gocoder-6m beside the checkout\n" +
			"or the executable, else a tiny random-weight model synthesized once into the user cache directory.\n" +
			"An empty or missing --model directory gets the synthesized model too. See docs/demo.md.",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "model", Usage: "Hugging Face model directory (default: gocoder-6m, else a synthesized tiny model)", EnvVars: envVars("model")},
			&cli.BoolFlag{Name: "synth", Usage: "use the synthesized tiny model even when gocoder-6m is found", EnvVars: cmdEnvVars("demo", "synth")},
			&cli.StringFlag{Name: "prompt", Value: demo.DefaultPrompt, Usage: "the user message of the demo's chat completion", EnvVars: cmdEnvVars("demo", "prompt")},
			&cli.IntFlag{Name: "max-tokens", Value: demo.DefaultMaxTokens, Usage: "tokens to generate at most", EnvVars: cmdEnvVars("demo", "max-tokens")},
			&cli.BoolFlag{Name: "once", Usage: "stop everything after the answer (for scripts and CI)", EnvVars: cmdEnvVars("demo", "once")},
			&cli.IntFlag{Name: "base-port", Usage: "relay on this port, tracker on +1, nodes on +2 and +3 (default: free ports)", EnvVars: cmdEnvVars("demo", "base-port")},
			&cli.StringFlag{Name: "backend", Value: "auto", Usage: "cpu, cuda or auto", EnvVars: envVars("backend")},
			&cli.StringFlag{Name: "cuda-lib", Usage: "path of libmeshgpu_cuda.so", EnvVars: envVars("cuda-lib")},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)", EnvVars: envVars("threads")},
			&cli.StringFlag{Name: "hop-dtype", Value: "f32", Usage: "activations between nodes: f32 (the answer equals one node's on cpu) or bf16", EnvVars: cmdEnvVars("demo", "hop-dtype")},
			&cli.BoolFlag{Name: "verbose", Usage: "show the servers' info logs (default: warnings and errors only)", EnvVars: cmdEnvVars("demo", "verbose")},
		}, backendFlags()...),
		Action: demoAction,
	})
}

func demoAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("demo takes no arguments, got %q (quote the prompt: --prompt \"...\")", c.Args().First())
	}
	if c.Int("max-tokens") < 1 {
		return fmt.Errorf("--max-tokens must be at least 1, not %d", c.Int("max-tokens"))
	}
	if p := c.Int("base-port"); p < 0 || p > 65532 {
		return fmt.Errorf("--base-port must be between 1 and 65532 (four ports from it are used), not %d", p)
	}
	if c.Int("threads") < 0 {
		return fmt.Errorf("--threads must not be negative")
	}
	if h := c.String("hop-dtype"); h != "f32" && h != "bf16" {
		return fmt.Errorf("--hop-dtype must be f32 or bf16, not %q", h)
	}
	cs, err := cudaSettings(c)
	if err != nil {
		return err
	}
	// The answer and the instructions go to stdout; the servers' logs to
	// stderr, at warning level unless --verbose, so they do not break up
	// the streamed answer (minLevel is bench.go's filter).
	log := slog.Default()
	if !c.Bool("verbose") {
		log = slog.New(minLevel{slog.Default().Handler(), slog.LevelWarn})
	}
	prog := newProgress("synthesizing the demo model")
	defer prog.Finish()
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	_, err = demo.Run(ctx, demo.Options{
		Model: c.String("model"), Synth: c.Bool("synth"),
		Prompt: c.String("prompt"), MaxTokens: c.Int("max-tokens"),
		Once: c.Bool("once"), BasePort: c.Int("base-port"),
		Backend: c.String("backend"), CUDALib: c.String("cuda-lib"), Threads: c.Int("threads"), CUDA: cs, CPUISA: c.String("cpu-isa"),
		HopDType: c.String("hop-dtype"),
		Out:      c.App.Writer, Logger: log, SynthProgress: prog.Update,
	})
	return err
}
