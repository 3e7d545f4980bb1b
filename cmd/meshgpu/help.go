package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/urfave/cli/v2"
)

// helpWidth is the widest line --help prints: it reads in a terminal of
// 100 columns, and in a code review.
const helpWidth = 100

// flagGroups sorts a command's flags into the groups its --help shows, in
// this order; flags in no group come last under "OTHER".
var flagGroups = map[string][]flagGroup{
	"run": {
		{"MODEL", []string{"model", "layers", "auto", "memory-budget", "move-grace", "chat-template-file"}},
		{"MESH", []string{"listen", "advertise", "no-listen", "relay", "relay-mode", "direct-paths", "direct-replies", "path-listen", "tracker", "heartbeat-interval",
			"drain-timeout", "peer", "route", "hop-dtype", "hop-timeout"}},
		{"LIMITS", []string{"max-sessions", "max-queue", "queue-wait", "max-batch", "prefill-chunk", "session-ttl",
			"max-context", "max-inflight-bytes"}},
		{"SPECULATIVE DECODING", []string{"speculate", "draft-model", "speculate-max", "speculate-inflight"}},
		{"SECURITY", []string{"key", "tls-cert", "tls-key", "api-key", "api-key-file", "allowed-origins", "trust-head",
			"hop-tls", "relay-join-token", "tracker-join-token"}},
		{"BACKEND (CPU, CUDA)", backendGroup},
	},
	"tracker": {
		{"MESH", []string{"listen", "advertise", "store", "etcd-prefix", "heartbeat-timeout", "relay", "page-refresh"}},
		{"ROUTING AND FAILOVER", []string{"ban-duration", "token-timeout", "max-attempts"}},
		{"SECURITY", []string{"key", "tls-cert", "tls-key", "api-key", "api-key-file", "allowed-origins", "join-token",
			"relay-join-token", "allow-loopback-endpoints", "allow-private-endpoints"}},
		{"LIMITS", []string{"max-nodes", "max-nodes-per-source", "max-models", "max-models-per-source", "max-layers-per-source", "max-tracker-layers"}},
		{"AUDITS", []string{"audit-rate", "audit-tolerance", "audit-probation", "audit-trusted", "audit-ban"}},
	},
	"relay": {
		{"LISTEN AND SECURITY", []string{"listen", "tls-cert", "tls-key", "join-token", "observe"}},
		{"LIMITS", []string{"max-frame-bytes", "max-inflight-per-peer", "request-timeout", "idle-timeout", "shutdown-timeout"}},
	},
	"bench": {
		{"OUTPUT", []string{"json", "plot", "wide"}},
		{"BACKEND (CPU, CUDA)", backendGroup},
	},
}

var backendGroup = []string{"backend", "threads", "cpu-isa", "cuda-lib", "cuda-attention", "cuda-prefill-attn", "cuda-graphs", "cuda-batch-mma", "cuda-fused-decode"}

type flagGroup struct {
	name  string
	flags []string
}

// installHelp makes every command's --help grouped and at most helpWidth
// columns wide; the app's and bench's list of suites keep urfave/cli's
// templates, wrapped at the same width.
func installHelp() {
	def := cli.HelpPrinterCustom
	cli.HelpPrinter = func(w io.Writer, templ string, data any) {
		if cmd, ok := data.(*cli.Command); ok && !hasSubcommands(cmd) {
			writeCommandHelp(w, cmd)
			return
		}
		def(w, templ, data, map[string]any{"wrapAt": func() int { return helpWidth }})
	}
}

// hasSubcommands: cmd has commands of its own (urfave/cli adds "help").
func hasSubcommands(cmd *cli.Command) bool {
	for _, s := range cmd.Subcommands {
		if s.Name != "help" {
			return true
		}
	}
	return false
}

// writeCommandHelp prints NAME, USAGE and the flags by group.
func writeCommandHelp(w io.Writer, cmd *cli.Command) {
	name := cmd.HelpName
	if name == "" {
		name = "meshgpu " + cmd.Name
	}
	fmt.Fprintf(w, "NAME:\n   %s\n\nUSAGE:\n   %s [options]%s\n", wrapText(name+" - "+cmd.Usage, 3, helpWidth), name, argsUsage(cmd))
	if cmd.Description != "" {
		fmt.Fprintf(w, "\nDESCRIPTION:\n   %s\n", wrapText(cmd.Description, 3, helpWidth))
	}
	groups := flagGroups[cmd.Name]
	if parent, _, ok := strings.Cut(name, " "+cmd.Name); ok && strings.HasSuffix(parent, "bench") {
		// a bench suite: its own flags first, then output and backend
		groups = append([]flagGroup{{"SUITE " + strings.ToUpper(cmd.Name), nil}}, flagGroups["bench"]...)
	}
	byName := map[string]cli.Flag{}
	var order []string
	for _, f := range cmd.VisibleFlags() {
		n := f.Names()[0]
		if n == "help" {
			continue
		}
		byName[n] = f
		order = append(order, n)
	}
	placed := map[string]bool{}
	var catchAll *flagGroup
	for i := range groups {
		if groups[i].flags == nil {
			catchAll = &groups[i]
			continue
		}
		for _, n := range groups[i].flags {
			placed[n] = true
		}
	}
	var rest []string
	for _, n := range order {
		if !placed[n] {
			rest = append(rest, n)
		}
	}
	if catchAll != nil {
		catchAll.flags = rest
		rest = nil
	}
	for _, g := range groups {
		writeFlagGroup(w, g.name, g.flags, byName)
	}
	title := "OPTIONS"
	if len(groups) > 0 {
		title = "OTHER"
	}
	writeFlagGroup(w, title, rest, byName)
	if cmd.Name == "run" || cmd.Name == "tracker" || cmd.Name == "relay" {
		fmt.Fprintf(w, "\nLOGGING (global options, before the command):\n   %s\n",
			wrapText("meshgpu --log-level debug|info|warn|error --log-format text|json "+cmd.Name+" ... (MESHGPU_LOG_LEVEL, MESHGPU_LOG_FORMAT)", 3, helpWidth))
	}
}

func argsUsage(cmd *cli.Command) string {
	if cmd.ArgsUsage != "" {
		return " " + cmd.ArgsUsage
	}
	return ""
}

// flagColumn is the width of the flag names' column; a longer name puts
// its text on the next line.
const flagColumn = 30

func writeFlagGroup(w io.Writer, title string, names []string, byName map[string]cli.Flag) {
	var lines []string
	for _, n := range names {
		f, ok := byName[n]
		if !ok {
			continue
		}
		lines = append(lines, flagHelp(f))
	}
	if len(lines) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s:\n%s", title, strings.Join(lines, ""))
}

// flagHelp is one flag: "   --name value   usage (default: x) [$ENV]",
// the text wrapped in its column.
func flagHelp(f cli.Flag) string {
	var names []string
	for _, n := range f.Names() {
		if len(n) == 1 {
			names = append(names, "-"+n)
		} else {
			names = append(names, "--"+n)
		}
	}
	left := "   " + strings.Join(names, ", ")
	text := ""
	if d, ok := f.(cli.DocGenerationFlag); ok {
		if d.TakesValue() {
			left += " value"
		}
		text = d.GetUsage()
		if def := strings.Trim(d.GetDefaultText(), `"`); def != "" && def != "0" && def != "0s" && def != "false" && def != "[]" && !strings.Contains(text, "(default") {
			text += " (default: " + def + ")"
		}
		if env := d.GetEnvVars(); len(env) > 0 {
			text += " [$" + strings.Join(env, ", $") + "]"
		}
	}
	pad := flagColumn + 3
	if len(left)+2 > pad {
		return left + "\n" + strings.Repeat(" ", pad) + wrapText(text, pad, helpWidth) + "\n"
	}
	return left + strings.Repeat(" ", pad-len(left)) + wrapText(text, pad, helpWidth) + "\n"
}

// wrapText wraps s at width, the lines after the first indented by indent.
func wrapText(s string, indent, width int) string {
	var b strings.Builder
	col := indent
	for i, word := range strings.Fields(s) {
		if i > 0 {
			if col+1+len(word) > width {
				b.WriteString("\n" + strings.Repeat(" ", indent))
				col = indent
			} else {
				b.WriteByte(' ')
				col++
			}
		}
		b.WriteString(word)
		col += len(word)
	}
	return b.String()
}
