package main

import (
	"bytes"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"meshgpu/native"
	"meshgpu/node"
	"meshgpu/relay"
	"meshgpu/tracker"
)

// envRun runs `meshgpu args...` in this process with the real flags of the
// named command (copies: urfave/cli writes env values into a flag's
// struct) and an Action that records the flags' values instead of serving.
// It returns those values and the log lines.
func envRun(t *testing.T, args ...string) (map[string]string, string, error) {
	t.Helper()
	var orig *cli.Command
	for _, c := range commands {
		if c.Name == args[0] {
			orig = c
		}
	}
	if orig == nil {
		t.Fatalf("no command %q", args[0])
	}
	cmd := *orig
	cmd.Flags = nil
	for _, f := range orig.Flags {
		v := reflect.ValueOf(f).Elem()
		cp := reflect.New(v.Type())
		cp.Elem().Set(v)
		cmd.Flags = append(cmd.Flags, cp.Interface().(cli.Flag))
	}
	got := map[string]string{}
	cmd.Action = func(c *cli.Context) error {
		for _, f := range cmd.Flags {
			name := f.Names()[0]
			got[name] = c.String(name)
			if d, ok := f.(*cli.DurationFlag); ok {
				got[name] = c.Duration(d.Name).String()
			}
		}
		return nil
	}
	var logs bytes.Buffer
	prev := slog.Default()
	t.Cleanup(func() { slog.SetDefault(prev) })
	app := &cli.App{
		Name:     "meshgpu",
		Commands: []*cli.Command{&cmd},
		Before: func(*cli.Context) error {
			slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))
			return nil
		},
	}
	err := app.Run(append([]string{"meshgpu"}, args...))
	return got, logs.String(), err
}

// clearMeshgpuEnv unsets the variables these tests use (restored after
// the test), so the caller's environment does not leak in.
func clearMeshgpuEnv(t *testing.T) {
	for _, n := range []string{"MESHGPU_LISTEN", "MESHGPU_JOIN_TOKEN", "MESHGPU_RELAY_JOIN_TOKEN", "MESHGPU_TRACKER_JOIN_TOKEN",
		"MESHGPU_RUN_LISTEN", "MESHGPU_RELAY_LISTEN", "MESHGPU_TRACKER_LISTEN", "MESHGPU_HEARTBEAT_TIMEOUT",
		"MESHGPU_TRACKER_HEARTBEAT_TIMEOUT", "MESHGPU_NO_LISTEN", "MESHGPU_RUN_NO_LISTEN", "MESHGPU_RUN_RELAY_JOIN_TOKEN",
		"MESHGPU_TRACKER_RELAY_JOIN_TOKEN", "MESHGPU_RUN_TRACKER_JOIN_TOKEN"} {
		t.Setenv(n, "")
		os.Unsetenv(n)
	}
}

func TestEnvOldNameWorksAndWarns(t *testing.T) {
	for _, c := range []struct{ cmd, newName string }{
		{"run", "MESHGPU_RUN_LISTEN"}, {"relay", "MESHGPU_RELAY_LISTEN"}, {"tracker", "MESHGPU_TRACKER_LISTEN"},
	} {
		t.Run(c.cmd, func(t *testing.T) {
			clearMeshgpuEnv(t)
			t.Setenv("MESHGPU_LISTEN", "127.0.0.1:4321")
			args := []string{c.cmd}
			if c.cmd == "run" {
				args = append(args, "--model", "m") // required
			}
			got, logs, err := envRun(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			if got["listen"] != "127.0.0.1:4321" {
				t.Errorf("--listen = %q, want the old variable's 127.0.0.1:4321", got["listen"])
			}
			lines := strings.Split(strings.TrimSpace(logs), "\n")
			if len(lines) != 1 || !strings.Contains(lines[0], "level=WARN") || !strings.Contains(lines[0], "MESHGPU_LISTEN is deprecated") ||
				!strings.Contains(lines[0], c.newName) {
				t.Errorf("want one warning naming %s, got %q", c.newName, logs)
			}
		})
	}
	// Other flag types go through the same path: a duration, a bool.
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_HEARTBEAT_TIMEOUT", "42s")
	if got, _, err := envRun(t, "tracker"); err != nil || got["heartbeat-timeout"] != "42s" {
		t.Errorf("tracker --heartbeat-timeout from MESHGPU_HEARTBEAT_TIMEOUT = %q, %v", got["heartbeat-timeout"], err)
	}
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_NO_LISTEN", "true")
	if got, _, err := envRun(t, "run", "--model", "m"); err != nil || got["no-listen"] != "true" {
		t.Errorf("run --no-listen from MESHGPU_NO_LISTEN = %q, %v", got["no-listen"], err)
	}
	// A bad old value is an error naming the variable.
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_HEARTBEAT_TIMEOUT", "soon")
	if _, _, err := envRun(t, "tracker"); err == nil || !strings.Contains(err.Error(), "MESHGPU_HEARTBEAT_TIMEOUT") {
		t.Errorf("bad old value: error %v, want one naming MESHGPU_HEARTBEAT_TIMEOUT", err)
	}
}

func TestEnvNewNameWinsAndDoesNotWarn(t *testing.T) {
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_RELAY_LISTEN", "127.0.0.1:5555")
	got, logs, err := envRun(t, "relay")
	if err != nil || got["listen"] != "127.0.0.1:5555" || logs != "" {
		t.Errorf("MESHGPU_RELAY_LISTEN: --listen %q, err %v, logs %q; want 127.0.0.1:5555 and no warning", got["listen"], err, logs)
	}
	// Both set: the new name wins; the old one still draws the warning.
	t.Setenv("MESHGPU_LISTEN", "127.0.0.1:4321")
	got, logs, err = envRun(t, "relay")
	if err != nil || got["listen"] != "127.0.0.1:5555" || !strings.Contains(logs, "MESHGPU_RELAY_LISTEN") {
		t.Errorf("both set: --listen %q, err %v, logs %q", got["listen"], err, logs)
	}
	// The command line wins over the old name, as it did before.
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_LISTEN", "127.0.0.1:4321")
	if got, _, err := envRun(t, "relay", "--listen", "127.0.0.1:6666"); err != nil || got["listen"] != "127.0.0.1:6666" {
		t.Errorf("--listen on the command line: %q, %v", got["listen"], err)
	}
}

// The secrets relay and tracker hold stay apart, and one command's
// variables do not set another's flags.
func TestEnvPerCommandNamesDoNotLeak(t *testing.T) {
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_RELAY_JOIN_TOKEN", "relay-secret")
	t.Setenv("MESHGPU_TRACKER_JOIN_TOKEN", "tracker-secret")
	t.Setenv("MESHGPU_RUN_LISTEN", "127.0.0.1:1111")
	t.Setenv("MESHGPU_TRACKER_LISTEN", "127.0.0.1:3333")
	if got, _, err := envRun(t, "relay"); err != nil || got["join-token"] != "relay-secret" || got["listen"] != relay.DefaultListen {
		t.Errorf("relay: --join-token %q --listen %q (%v); want relay-secret and the default", got["join-token"], got["listen"], err)
	}
	if got, _, err := envRun(t, "tracker"); err != nil || got["join-token"] != "tracker-secret" || got["listen"] != "127.0.0.1:3333" {
		t.Errorf("tracker: --join-token %q --listen %q (%v); want tracker-secret and 127.0.0.1:3333", got["join-token"], got["listen"], err)
	}
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_RELAY_LISTEN", "127.0.0.1:2222")
	if got, _, err := envRun(t, "run", "--model", "m"); err != nil || got["listen"] != node.DefaultListen {
		t.Errorf("run --listen = %q (%v), want the default: MESHGPU_RELAY_LISTEN is the relay's", got["listen"], err)
	}
	if got, _, err := envRun(t, "tracker"); err != nil || got["listen"] != tracker.DefaultListen {
		t.Errorf("tracker --listen = %q (%v), want the default", got["listen"], err)
	}
}

// The rule the README states, for every flag: MESHGPU_<COMMAND>_<FLAG>
// (FLAG: the flag's longest name), MESHGPU_<FLAG> for the app-wide flags
// and sharedFlags, and no command-specific name read by two commands.
func TestEnvNamesFollowTheRule(t *testing.T) {
	app := newApp()
	for _, f := range app.Flags {
		if want := envVars(longestName(f)); !reflect.DeepEqual(flagEnv(f), want) {
			t.Errorf("app flag --%s reads %v, want %v", longestName(f), flagEnv(f), want)
		}
	}
	owner := map[string]string{}
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			word := c.Name
			if len(path) > 0 && path[0] == "bench" {
				word = "bench" // the suites share bench's flags
			}
			full := strings.Join(append(append([]string{}, path...), c.Name), " ")
			for _, f := range c.Flags {
				name := longestName(f)
				if name == "help" {
					continue
				}
				want := cmdEnvVars(word, name)
				if sharedFlags[name] {
					want = envVars(name)
				}
				if !reflect.DeepEqual(flagEnv(f), want) {
					t.Errorf("meshgpu %s --%s reads %v, want %v", full, name, flagEnv(f), want)
				}
				for _, e := range flagEnv(f) {
					if o, ok := owner[e]; ok && o != word && !sharedFlags[name] {
						t.Errorf("%s is read by %s and %s", e, o, word)
					}
					owner[e] = word
				}
			}
			walk(append(append([]string{}, path...), c.Name), c.Subcommands)
		}
	}
	walk(nil, app.Commands)
}

func longestName(f cli.Flag) string {
	var n string
	for _, s := range f.Names() {
		if len(s) > len(n) {
			n = s
		}
	}
	return n
}

func flagEnv(f cli.Flag) []string {
	if e, ok := f.(interface{ GetEnvVars() []string }); ok {
		return e.GetEnvVars()
	}
	return nil
}

// The CUDA settings the library once read from the environment itself are
// flags now, under the same variable names, on every command that opens a
// backend; a bad value is one line naming the flag.
func TestCUDASettingsFlags(t *testing.T) {
	clearMeshgpuEnv(t)
	t.Setenv("MESHGPU_CUDA_ATTENTION", "f32")
	t.Setenv("MESHGPU_CUDA_PREFILL_ATTN", "tiled")
	t.Setenv("MESHGPU_CUDA_GRAPHS", "0")
	t.Setenv("MESHGPU_CUDA_FUSED_DECODE", "1")
	for _, args := range [][]string{{"run", "--model", "m"}, {"generate", "--model", "m", "--prompt", "p"}, {"demo"}} {
		got, _, err := envRun(t, args...)
		if err != nil || got["cuda-attention"] != "f32" || got["cuda-prefill-attn"] != "tiled" || got["cuda-graphs"] != "false" ||
			got["cuda-fused-decode"] != "true" {
			t.Errorf("%s: %v, cuda flags %q %q %q %q", args[0], err, got["cuda-attention"], got["cuda-prefill-attn"],
				got["cuda-graphs"], got["cuda-fused-decode"])
		}
	}
	for _, c := range []struct{ flag, value, want string }{
		{"--cuda-attention", "f16", "--cuda-attention must be bf16 or f32"},
		{"--cuda-prefill-attn", "flash", "--cuda-prefill-attn must be auto or tiled"},
	} {
		_, stderr, code := runMeshgpu(t, "generate", "--model", t.TempDir(), "--prompt", "p", c.flag, c.value)
		if code == 0 || !strings.Contains(stderr, c.want) || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
			t.Errorf("%s %s: exit %d, stderr %q; want one line saying %q", c.flag, c.value, code, stderr, c.want)
		}
	}
}

// Each boolean kernel flag lands in its CUDASettings field, and only there.
func TestCUDASettingsBoolFlags(t *testing.T) {
	clearMeshgpuEnv(t)
	for _, c := range []struct {
		args []string
		want native.CUDASettings
	}{
		{nil, native.CUDASettings{}},
		{[]string{"--cuda-fused-decode"}, native.CUDASettings{FusedDecode: true}},
		{[]string{"--cuda-batch-mma"}, native.CUDASettings{BatchMMA: true}},
		{[]string{"--cuda-graphs=false"}, native.CUDASettings{NoGraphs: true}},
	} {
		var got native.CUDASettings
		app := &cli.App{Flags: backendFlags(), Action: func(ctx *cli.Context) (err error) {
			got, err = cudaSettings(ctx)
			return err
		}}
		if err := app.Run(append([]string{"meshgpu"}, c.args...)); err != nil || got != c.want {
			t.Errorf("%v: %+v, %v; want %+v", c.args, got, err, c.want)
		}
	}
}
