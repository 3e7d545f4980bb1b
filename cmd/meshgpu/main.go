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

func register(c *cli.Command) {
	setLegacyEnv(c)
	commands = append(commands, c)
}

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

// Environment variables (README, "Configuration"). A command's own flag
// reads MESHGPU_<COMMAND>_<FLAG> (`meshgpu run --hop-timeout`:
// MESHGPU_RUN_HOP_TIMEOUT), so one variable never means two things to two
// commands: relay's and tracker's --join-token hold different secrets. The
// app-wide flags and sharedFlags, which mean the same in every command that
// has them, read MESHGPU_<FLAG>.

// sharedFlags are the command flags that read MESHGPU_<FLAG>: the same
// machine-wide setting in every command that has them.
var sharedFlags = map[string]bool{"model": true, "backend": true, "cuda-lib": true, "threads": true,
	"cuda-attention": true, "cuda-prefill-attn": true, "cuda-graphs": true, "cuda-batch-mma": true, "cuda-fused-decode": true, "cpu-isa": true,
	"api-key": true, "api-key-file": true, "allowed-origins": true}

// envName is MESHGPU_ and the words, upper case, '-' as '_'.
func envName(words ...string) string {
	return "MESHGPU_" + strings.ToUpper(strings.ReplaceAll(strings.Join(words, "_"), "-", "_"))
}

// envVars names the variable of an app-wide or shared flag: MESHGPU_<FLAG>.
func envVars(flag string) []string { return []string{envName(flag)} }

// cmdEnvVars names the variable of a command's own flag:
// MESHGPU_<COMMAND>_<FLAG>.
func cmdEnvVars(command, flag string) []string { return []string{envName(command, flag)} }

// legacyVar is a flag's old variable, MESHGPU_<FLAG>, from before run,
// relay and tracker got per-command names.
type legacyVar struct{ flag, oldName, newName string }

// deprecatedEnv lists each command's old variables.
var deprecatedEnv = map[string][]legacyVar{}

// legacyEnvVars is cmdEnvVars for a flag that used to read MESHGPU_<FLAG>.
// The old name keeps working: when the new variable is unset and the flag
// is not on the command line, the command reads the old one and logs a
// deprecation warning (applyLegacyEnv). Help lists only the new name.
func legacyEnvVars(command, flag string) []string {
	newName := envName(command, flag)
	deprecatedEnv[command] = append(deprecatedEnv[command], legacyVar{flag, envName(flag), newName})
	return []string{newName}
}

// applyLegacyEnv reads the old variables set for command, each with one
// warning line that names the new variable.
func applyLegacyEnv(c *cli.Context, command string) error {
	for _, v := range deprecatedEnv[command] {
		val, ok := os.LookupEnv(v.oldName)
		if !ok {
			continue
		}
		slog.Warn(v.oldName+" is deprecated: meshgpu "+command+" reads "+v.newName, "deprecated", v.oldName, "use", v.newName)
		if _, ok := os.LookupEnv(v.newName); ok || c.IsSet(v.flag) {
			continue // the new name or the command line wins, as it did over the old name
		}
		if err := c.Set(v.flag, val); err != nil {
			return fmt.Errorf("%s (deprecated name of %s) %q: %w", v.oldName, v.newName, val, err)
		}
	}
	return nil
}

// setLegacyEnv makes a command with old variables read them
// before it runs (after the app's Before has set up the logger).
func setLegacyEnv(c *cli.Command) {
	if len(deprecatedEnv[c.Name]) == 0 {
		return
	}
	name, before := c.Name, c.Before
	c.Before = func(ctx *cli.Context) error {
		if err := applyLegacyEnv(ctx, name); err != nil {
			return err
		}
		if before != nil {
			return before(ctx)
		}
		return nil
	}
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
	installHelp()
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
