package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"meshgpu/bench"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// The acceptance of issue 8: `meshgpu bench hops --plot x.svg` produces a
// chart that parses as SVG and names every series; --json has all four.
func TestBenchHopsPlotAndJSON(t *testing.T) {
	dir := t.TempDir()
	svg, js := filepath.Join(dir, "x.svg"), filepath.Join(dir, "x.json")
	stdout, stderr, code := runMeshgpu(t, "bench", "hops", "--n", "20", "--plot", svg, "--json", js)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, s := range bench.HopSeries {
		if !strings.Contains(stdout, s) {
			t.Errorf("table lacks %s:\n%s", s, stdout)
		}
	}
	if err := bench.CheckSVG(svg, bench.HopSeries...); err != nil {
		t.Error(err)
	}
	data, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var rep bench.Report
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatalf("--json: %v", err)
	}
	if rep.Suite != "hops" || !slices.Equal(rep.Series(), bench.HopSeries) {
		t.Fatalf("--json: suite %q, series %v; want hops with %v", rep.Suite, rep.Series(), bench.HopSeries)
	}
	for _, s := range bench.HopSeries {
		for _, kib := range []float64{4, 8} {
			r, ok := rep.Find(s, kib)
			if !ok || r.N != 20 || r.P50 <= 0 || r.Extra["wire_B"] < 2*kib*1024 {
				t.Errorf("%s at %v KiB: %+v", s, kib, r)
			}
		}
	}
}

// Each other suite runs through the CLI with tiny settings and prints its
// expected rows.
func TestBenchSuitesSmoke(t *testing.T) {
	cache := t.TempDir()
	cases := []struct {
		args []string
		rows []string
	}{
		{[]string{"kernels", "--synth", "tiny", "--n", "2", "--contexts", "16"}, []string{"matvec", "matmul", "rmsnorm", "attention", "bw-floor"}},
		{[]string{"layers", "--synth", "tiny:4", "--n", "2", "--prompt-tokens", "4"}, []string{"forward", "bw-floor"}},
		{[]string{"decode", "--synth", "tiny", "--n", "3", "--prompt-tokens", "4"}, []string{"meshgpu-cpu", "bw-floor"}},
		{[]string{"prefill", "--synth", "tiny", "--n", "2", "--prompt-tokens", "12"}, []string{"meshgpu-cpu"}},
		{[]string{"mesh", "--synth", "tiny:3", "--n", "3", "--prompt-tokens", "4", "--relay"}, []string{"one-node", "mesh", "mesh-relay"}},
		{[]string{"streams", "--synth", "tiny", "--n", "3", "--prompt-tokens", "4", "--streams", "3"}, []string{"one-stream", "concurrent-streams"}},
	}
	for _, c := range cases {
		js := filepath.Join(t.TempDir(), "r.json")
		args := append([]string{"bench"}, c.args...)
		args = append(args, "--backend", "cpu", "--cache-dir", cache, "--json", js)
		stdout, stderr, code := runMeshgpu(t, args...)
		if code != 0 {
			t.Errorf("%v: exit %d: %s", c.args, code, stderr)
			continue
		}
		data, err := os.ReadFile(js)
		var rep bench.Report
		if err == nil {
			err = json.Unmarshal(data, &rep)
		}
		if err != nil {
			t.Errorf("%v: --json: %v", c.args, err)
			continue
		}
		got := rep.Series()
		slices.Sort(got)
		if want := slices.Sorted(slices.Values(c.rows)); !slices.Equal(got, want) {
			t.Errorf("%v: series %v, want %v\n%s", c.args, got, want, stdout)
		}
		for _, r := range c.rows {
			if !strings.Contains(stdout, r) {
				t.Errorf("%v: table lacks %s", c.args, r)
			}
		}
	}
}

// isaProbe is a CPU path the backend must run and name when asked (one
// this machine supports besides the default), or else one it must refuse.
func isaProbe() (name string, runs bool) {
	supported := native.CPUISAs()
	for _, s := range supported {
		if s != native.CPUISA() {
			return s, true
		}
	}
	for _, s := range []string{"scalar", "avx2", "avx512f", "avx512bf16"} {
		if !slices.Contains(supported, s) {
			return s, false
		}
	}
	return "", false
}

// checkISA: a command given isa either ran on it (its output names it) or
// refused it as unsupported; without the flag reaching the backend it
// would run the default and say so.
func checkISA(t *testing.T, what, isa string, runs bool, stdout, stderr string, code int) {
	t.Helper()
	if runs {
		if code != 0 || !strings.Contains(stdout, "("+isa) {
			t.Errorf("%s with cpu isa %s: exit %d, the backend does not say %s:\n%s\n%s", what, isa, code, isa, stdout, stderr)
		}
		return
	}
	if code == 0 || !strings.Contains(stderr, "not supported here") {
		t.Errorf("%s with unsupported cpu isa %s: exit %d, no refusal:\n%s", what, isa, code, stderr)
	}
}

// --cpu-isa reaches the backend a bench suite opens.
func TestBenchCPUISA(t *testing.T) {
	isa, runs := isaProbe()
	cache := t.TempDir()
	for _, suite := range []string{"decode", "prefill"} {
		stdout, stderr, code := runMeshgpu(t, "bench", suite, "--synth", "tiny", "--n", "2", "--prompt-tokens", "4",
			"--backend", "cpu", "--cpu-isa", isa, "--cache-dir", cache, "--wide")
		checkISA(t, "bench "+suite, isa, runs, stdout, stderr, code)
	}
}

func TestBenchBadInput(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{}, "one suite"},
		{[]string{"warp"}, "unknown suite"},
		{[]string{"hops", "--plot", "x.gif"}, "--plot"},
		{[]string{"hops", "--n", "-1"}, "--n"},
		{[]string{"hops", "--payload-kib", "0"}, "payload"},
		{[]string{"hops", "--rtt", "-5ms"}, "--rtt"},
		{[]string{"hops", "--rtt", "2s"}, "--rtt"},
		{[]string{"layers", "--synth", "gpt-5"}, "unknown shape"},
		{[]string{"layers", "--synth", "tiny:0"}, "layers must be"},
		{[]string{"layers", "--model", "/nonexistent", "--backend", "cpu"}, "--model"},
		{[]string{"mesh", "--synth", "tiny", "--nodes", "5", "--backend", "cpu", "--cache-dir", t.TempDir()}, "--nodes"},
		{[]string{"mesh", "--hop-dtype", "f16", "--synth", "tiny", "--backend", "cpu", "--cache-dir", t.TempDir()}, "hop dtype"},
		{[]string{"kernels", "--model", "."}, "--synth"},
		{[]string{"streams", "--streams", "1", "--synth", "tiny"}, "--streams"},
		{[]string{"streams", "--streams", "65", "--synth", "tiny"}, "--streams"},
		{[]string{"streams", "--max-batch", "-1", "--synth", "tiny"}, "--max-batch"},
		{[]string{"decode", "--backend", "tpu", "--synth", "tiny", "--cache-dir", t.TempDir()}, "backend"},
		{[]string{"prefill", "--cpu-isa", "sse9", "--backend", "cpu", "--synth", "tiny", "--cache-dir", t.TempDir()}, "cpu isa"},
	}
	for _, c := range cases {
		_, stderr, code := runMeshgpu(t, append([]string{"bench"}, c.args...)...)
		oneErrorLine(t, stderr, code, c.want)
		if strings.Contains(stderr, "panic") {
			t.Errorf("%v: %s", c.args, stderr)
		}
	}
}

// `meshgpu bench perplexity` on gocoder-6m and the text llama.cpp scored:
// the table, and JSON with llama.cpp's chunk count, a perplexity within
// 0.2% of its f32 one, and null KL numbers without --kl-base.
func TestBenchPerplexityCLI(t *testing.T) {
	dir := testenv.GoCoder(t)
	text := testenv.Shared(t, "models/gocoder-6m-gguf/ppl-text.txt")
	js := filepath.Join(t.TempDir(), "ppl.json")
	stdout, stderr, code := runMeshgpu(t, "bench", "perplexity", "--model", dir, "--file", text, "--ctx", "128",
		"--backend", "cpu", "--threads", "2", "--json", js)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, s := range []string{"suite perplexity", bench.SeriesPPLModel, "ppl"} {
		if !strings.Contains(stdout, s) {
			t.Errorf("table lacks %q:\n%s", s, stdout)
		}
	}
	data, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("--json: %v", err)
	}
	const llamaCppF32 = 5.3932 // reference.json files.f32.ppl
	if ppl, _ := got["ppl"].(float64); got["chunks"] != 36.0 || ppl < llamaCppF32*0.998 || ppl > llamaCppF32*1.002 {
		t.Errorf("--json: chunks %v, ppl %v; want 36 and %v within 0.2%%", got["chunks"], got["ppl"], llamaCppF32)
	}
	for _, k := range []string{"mean_kld", "same_top_pct"} {
		if v, ok := got[k]; !ok || v != nil {
			t.Errorf("--json %s: %v (present %v), want null without --kl-base", k, v, ok)
		}
	}
}

// Each mistake in a perplexity run is one error line saying what to fix.
func TestBenchPerplexityBadInput(t *testing.T) {
	dir := testenv.GoCoder(t)
	text := testenv.Shared(t, "models/gocoder-6m-gguf/ppl-text.txt")
	tmp := t.TempDir()
	short := filepath.Join(tmp, "short.txt")
	if err := os.WriteFile(short, []byte("package main\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tiny := filepath.Join(tmp, "tiny") // vocabulary 512, gocoder's 4096
	if _, stderr, code := runMeshgpu(t, "--log-level", "error", "model", "synth", "--shape", "tiny", "--out", tiny); code != 0 {
		t.Fatalf("synth: exit %d: %s", code, stderr)
	}
	run := []string{"perplexity", "--backend", "cpu", "--threads", "2", "--model", dir}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--file", short}, "fewer than one chunk of --ctx 128: use a longer text or a smaller --ctx"},
		{[]string{"--file", text, "--ctx", "127"}, "--ctx 127: the chunk length must be even"},
		{[]string{"--file", text, "--ctx", "2"}, "--ctx 2: the chunk length must be even and 4"},
		{[]string{"--file", text, "--kl-base", tiny}, "the base must share the model's tokenizer"},
		{[]string{"--file", text, "--kl-base", filepath.Join(tmp, "none")}, "--kl-base"},
		{[]string{}, "pass --file TEXT"},
		{[]string{"--file", text, "--plot", "x.svg"}, "--plot: bench perplexity draws no chart"},
	}
	for _, c := range cases {
		_, stderr, code := runMeshgpu(t, append(append([]string{"bench"}, run...), c.args...)...)
		oneErrorLine(t, stderr, code, c.want)
	}
}
