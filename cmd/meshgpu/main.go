// Command meshgpu is the GPU inference node of Meshnet: run a shard of a
// model, a relay, a tracker, or the bench suites.
package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"

	"github.com/urfave/cli/v2"

	"meshgpu/internal/buildinfo"
)

// commands is filled by each command's file in its init, so commands can be
// added without touching this file.
var commands []*cli.Command

func register(c *cli.Command) { commands = append(commands, c) }

func init() {
	register(&cli.Command{
		Name:  "version",
		Usage: "print the version (from -ldflags -X meshgpu/internal/buildinfo.Version=..., else the Go build info)",
		Action: func(*cli.Context) error {
			fmt.Println(buildinfo.Get().String())
			return nil
		},
	})
}

// envVars names the MESHGPU_* variable of a flag: --hop-timeout reads
// MESHGPU_HOP_TIMEOUT. Every flag should use it.
func envVars(flag string) []string {
	return []string{"MESHGPU_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))}
}

// quietUsageError reports a bad flag as the one error line main prints,
// instead of the whole help text.
func quietUsageError(c *cli.Context, err error, _ bool) error {
	var names []string
	if c != nil {
		for _, ctx := range c.Lineage() {
			if ctx.Command != nil && ctx.Command.Name != "" && ctx.Command.Name != "meshgpu" &&
				(len(names) == 0 || names[0] != ctx.Command.Name) {
				names = append([]string{ctx.Command.Name}, names...)
			}
		}
	}
	return fmt.Errorf("%w (see %s --help)", err, strings.Join(append([]string{"meshgpu"}, names...), " "))
}

func setQuietUsage(cmds []*cli.Command) {
	for _, c := range cmds {
		if c.OnUsageError == nil {
			c.OnUsageError = quietUsageError
		}
		checkRequiredQuietly(c)
		setQuietUsage(c.Subcommands)
	}
}

// checkRequiredQuietly moves the check of c's required flags into its
// action: urfave/cli prints the whole help above a missing flag's error,
// where one line saying which flag is missing is what helps.
func checkRequiredQuietly(c *cli.Command) {
	var required []string
	for _, f := range c.Flags {
		if sf, ok := f.(*cli.StringFlag); ok && sf.Required {
			sf.Required = false
			sf.Usage += " (required)"
			required = append(required, sf.Name)
		}
	}
	if len(required) == 0 || c.Action == nil {
		return
	}
	action := c.Action
	c.Action = func(ctx *cli.Context) error {
		for _, name := range required {
			if !ctx.IsSet(name) || ctx.String(name) == "" {
				return quietUsageError(ctx, fmt.Errorf("--%s is required", name), false)
			}
		}
		return action(ctx)
	}
}

func newApp() *cli.App {
	sort.Slice(commands, func(i, j int) bool { return commands[i].Name < commands[j].Name })
	setQuietUsage(commands)
	in := buildinfo.Get()
	cli.VersionFlag = &cli.BoolFlag{Name: "version", Usage: "print the version and exit"}
	cli.VersionPrinter = func(*cli.Context) { fmt.Println(in.String()) }
	return &cli.App{
		OnUsageError: quietUsageError,
		Version:      in.Version,
		Name:         "meshgpu",
		Usage:        "the GPU inference node of Meshnet",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "log-format", Value: "text", Usage: "log format: text or json", EnvVars: envVars("log-format")},
			&cli.StringFlag{Name: "log-level", Value: "info", Usage: "log level: debug, info, warn, error", EnvVars: envVars("log-level")},
		},
		Before: func(c *cli.Context) error {
			var level slog.Level
			if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			opts := &slog.HandlerOptions{Level: level}
			switch c.String("log-format") {
			case "text":
				slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, opts)))
			case "json":
				slog.SetDefault(slog.New(slog.NewJSONHandler(os.Stderr, opts)))
			default:
				return fmt.Errorf("--log-format must be text or json, not %q", c.String("log-format"))
			}
			return nil
		},
		Commands:        commands,
		HideHelpCommand: true,
	}
}

func main() {
	if err := newApp().Run(os.Args); err != nil {
		// One line that says what to fix; no stack traces.
		msg := err.Error()
		var ec cli.ExitCoder
		code := 1
		if errors.As(err, &ec) && ec.ExitCode() != 0 {
			code = ec.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "meshgpu: "+strings.ReplaceAll(msg, "\n", "; "))
		os.Exit(code)
	}
}
