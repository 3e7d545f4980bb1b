package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

type goldenGen struct {
	Generations []struct {
		Prompt    string  `json:"prompt"`
		PromptIDs []int32 `json:"prompt_ids"`
		FP32      struct {
			GreedyIDs  []int32 `json:"greedy_ids"`
			GreedyText string  `json:"greedy_text"`
		} `json:"fp32"`
	} `json:"generations"`
}

func readGoldenGen(t *testing.T, dir string) goldenGen {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Skipf("golden.json: %v", err)
	}
	var g goldenGen
	if err := json.Unmarshal(data, &g); err != nil || len(g.Generations) < 2 {
		t.Fatalf("golden.json: %v", err)
	}
	return g
}

// TestGenerateCLIGolden: `meshgpu generate` streams HF's greedy text for a
// golden prompt, and --json with a split (--layers) gives the golden ids.
func TestGenerateCLIGolden(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := readGoldenGen(t, dir)
	gen := g.Generations[1]
	stdout, stderr, code := runMeshgpu(t, "generate", "--model", dir, "--prompt", gen.Prompt, "-n", "64", "--ignore-eos", "--backend", "cpu")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if stdout != gen.FP32.GreedyText+"\n" {
		t.Errorf("stdout %q, want golden greedy text %q", stdout, gen.FP32.GreedyText)
	}

	gen = g.Generations[0]
	stdout, stderr, code = runMeshgpu(t, "generate", "--model", dir, "--prompt", gen.Prompt, "-n", "64", "--ignore-eos",
		"--backend", "cpu", "--layers", "0-2", "--hop-dtype", "f32", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var j generateJSON
	if err := json.Unmarshal([]byte(stdout), &j); err != nil {
		t.Fatalf("--json output %q: %v", stdout, err)
	}
	if !slices.Equal(j.PromptIDs, gen.PromptIDs) || !slices.Equal(j.IDs, gen.FP32.GreedyIDs) || j.Text != gen.FP32.GreedyText {
		t.Errorf("--layers 0-2 --json: prompt %v ids %v text %q\nwant prompt %v ids %v", j.PromptIDs, j.IDs, j.Text, gen.PromptIDs, gen.FP32.GreedyIDs)
	}
	if j.Timings.PrefillMS <= 0 || j.Timings.DecodeTokPerSec <= 0 || j.FinishReason != "length" {
		t.Errorf("--json timings %+v, finish %q", j.Timings, j.FinishReason)
	}
}

func TestGenerateCLIBadInput(t *testing.T) {
	dir := testenv.GoCoder(t)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--layers", "7-3"}, "reversed"},
		{[]string{"--layers", "0-9"}, "beyond the model"},
		{[]string{"-n", "0"}, "max tokens"},
		{[]string{"-n", "100000"}, "exceeds the context"},
		{[]string{"--temperature", "-1"}, "temperature"},
		{[]string{"--top-p", "2"}, "top_p"},
		{[]string{"--hop-dtype", "f16"}, "--hop-dtype"},
		{[]string{"--backend", "tpu"}, "unknown backend"},
		{[]string{"--backend", "cuda", "--cuda-lib", filepath.Join(t.TempDir(), "missing.so")}, "not found"},
	}
	for _, c := range cases {
		args := append([]string{"generate", "--model", dir, "--prompt", "x"}, c.args...)
		_, stderr, code := runMeshgpu(t, args...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if code == 0 || !strings.Contains(stderr, c.want) || len(lines) != 1 || strings.Contains(stderr, "panic") {
			t.Errorf("%v: exit %d, stderr %q (want one line with %q)", c.args, code, stderr, c.want)
		}
	}
	_, stderr, code := runMeshgpu(t, "generate", "--model", t.TempDir(), "--prompt", "x")
	if code == 0 || strings.Contains(stderr, "panic") {
		t.Errorf("empty model dir: exit %d, %q", code, stderr)
	}
}
