package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model"
)

// runProc is a running `meshgpu run` child.
type runProc struct {
	cmd    *exec.Cmd
	url    string
	stderr *bytes.Buffer
	exited chan error
}

func startRun(t *testing.T, args ...string) *runProc {
	t.Helper()
	cmd := meshgpuCmd(nil, append([]string{"run"}, args...)...)
	pr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &runProc{cmd: cmd, stderr: &bytes.Buffer{}, exited: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			line := sc.Text()
			p.stderr.WriteString(line + "\n")
			if _, rest, ok := strings.Cut(line, `msg="listening on `); ok {
				a, _, _ := strings.Cut(rest, `"`)
				addr <- a
			}
		}
		io.Copy(io.Discard, pr)
		p.exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	select {
	case a := <-addr:
		p.url = "http://" + a
	case <-time.After(30 * time.Second):
		t.Fatalf("meshgpu run %v did not start listening:\n%s", args, p.stderr)
	}
	return p
}

// stop sends SIGTERM and expects a clean exit.
func (p *runProc) stop(t *testing.T) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		if err != nil {
			t.Errorf("meshgpu run exited with %v after SIGTERM:\n%s", err, p.stderr)
		}
	case <-time.After(15 * time.Second):
		t.Errorf("meshgpu run did not stop within 15s of SIGTERM")
	}
}

// Three `meshgpu run` processes with overlapping layers serve a completion
// whose first 16 ids (bf16 hops) equal HF transformers' greedy ids, and
// stop cleanly on SIGTERM.
func TestRunThreeProcesses(t *testing.T) {
	dir := testenv.GoCoder(t)
	b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var golden struct {
		Generations []struct {
			PromptIDs []int32 `json:"prompt_ids"`
			FP32      struct {
				GreedyIDs []int32 `json:"greedy_ids"`
			} `json:"fp32"`
		} `json:"generations"`
	}
	if err := json.Unmarshal(b, &golden); err != nil || len(golden.Generations) == 0 {
		t.Fatalf("golden.json: %v", err)
	}
	keys := t.TempDir()
	common := []string{"--model", dir, "--backend", "cpu", "--listen", "127.0.0.1:0", "--threads", "1"}
	// The static mesh as documented: mid and tail take the head's tickets.
	headID, err := identity.LoadOrCreate(filepath.Join(keys, "a"))
	if err != nil {
		t.Fatal(err)
	}
	trust := []string{"--trust-head", headID.PeerID}
	tail := startRun(t, append(append(common, trust...), "--layers", "4-5", "--key", filepath.Join(keys, "c"))...)
	mid := startRun(t, append(append(common, trust...), "--layers", "2-4", "--key", filepath.Join(keys, "b"))...)
	head := startRun(t, append(common, "--layers", "0-2", "--key", filepath.Join(keys, "a"), "--peer", mid.url, "--peer", "tail="+tail.url)...)

	g := golden.Generations[0]
	body, _ := json.Marshal(map[string]any{"prompt": g.PromptIDs, "max_tokens": 16, "temperature": 0, "stream": true})
	resp, err := http.Post(head.url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var ids []int32
	done := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var c struct {
			Meshgpu *struct{ Token int32 } `json:"meshgpu"`
			Error   any                    `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
			t.Fatalf("event %s: %v", data, err)
		}
		if c.Meshgpu != nil {
			ids = append(ids, c.Meshgpu.Token)
		}
	}
	resp.Body.Close()
	if !done || fmt.Sprint(ids) != fmt.Sprint(g.FP32.GreedyIDs[:16]) {
		t.Errorf("3 processes: ids %v (done %v), want golden %v", ids, done, g.FP32.GreedyIDs[:16])
	}
	for _, p := range []*runProc{head, mid, tail} {
		p.stop(t)
	}
}

// Bad flags fail with one line that says what to fix.
func TestRunBadFlags(t *testing.T) {
	dir := testenv.GoCoder(t)
	tiny := t.TempDir() // vocabulary 512, gocoder-6m's is 4096
	if _, err := model.Synth(context.Background(), tiny, model.SynthOptions{Shape: "tiny"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--model", dir, "--hop-dtype", "int8"}, "--hop-dtype"},
		{[]string{"--model", dir, "--layers", "4-9"}, "--layers"},
		{[]string{"--model", dir, "--route", `[{"endpoint":"x"}]`}, "--route"},
		{[]string{"--model", dir, "--peer", "localhost:7002"}, "--peer"},
		{[]string{"--model", dir, "--trust-head", "not-a-peer-id"}, "--trust-head"},
		{[]string{"--model", t.TempDir()}, "--model"},
		{[]string{"--model", dir, "--speculate", "always"}, "--speculate"},
		{[]string{"--model", dir, "--speculate", "draft"}, "--draft-model"},
		{[]string{"--model", dir, "--speculate", "ngram", "--speculate-max", "0"}, "--speculate-max"},
		// a pass of 32+ rows would take the CPU's bf16 prefill products (node.MaxSpeculateDrafts)
		{[]string{"--model", dir, "--speculate", "ngram", "--speculate-max", "31"}, "--speculate-max must be 1 to 30"},
		{[]string{"--model", dir, "--speculate", "draft", "--draft-model", tiny}, "same tokenizer"},
		{[]string{"--model", dir, "--layers", "2-5", "--speculate", "ngram"}, "--speculate is for a head"},
	} {
		_, stderr, code := runMeshgpu(t, append([]string{"run"}, tc.args...)...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		last := lines[len(lines)-1]
		if code != 1 || !strings.Contains(last, tc.want) || !strings.HasPrefix(last, "meshgpu: ") {
			t.Errorf("run %v: exit %d, stderr %q; want exit 1 naming %s", tc.args, code, stderr, tc.want)
		}
	}
}

// meshgpu run --speculate draft --draft-model loads the draft model and
// the head drafts with it: every draft is accepted (the model drafts for
// itself) and the text is plain decoding's.
func TestRunSpeculatesWithADraftModel(t *testing.T) {
	dir := testenv.GoCoder(t)
	b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var golden struct {
		Generations []struct {
			PromptIDs []int32 `json:"prompt_ids"`
		} `json:"generations"`
	}
	if err := json.Unmarshal(b, &golden); err != nil || len(golden.Generations) == 0 {
		t.Fatalf("golden.json: %v", err)
	}
	head := startRun(t, "--model", dir, "--backend", "cpu", "--listen", "127.0.0.1:0", "--threads", "1",
		"--key", filepath.Join(t.TempDir(), "k"), "--speculate", "draft", "--draft-model", dir, "--speculate-max", "4")
	g := golden.Generations[0]
	body, _ := json.Marshal(map[string]any{"prompt": g.PromptIDs, "max_tokens": 24, "temperature": 0})
	resp, err := http.Post(head.url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("completion: %d %s", resp.StatusCode, out)
	}
	resp, err = http.Get(head.url + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Drafted  int64 `json:"speculative_draft_tokens"`
		Accepted int64 `json:"speculative_accepted_tokens"`
		Tokens   int64 `json:"tokens_generated"`
	}
	json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if st.Accepted == 0 || st.Accepted != st.Drafted {
		t.Errorf("stats %+v: want every draft of the model drafting for itself accepted", st)
	}
	// the text is plain decoding's (the same head, speculation off)
	var c struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	json.Unmarshal(out, &c)
	plain, _ := json.Marshal(map[string]any{"prompt": g.PromptIDs, "max_tokens": 24, "temperature": 0, "meshgpu": map[string]any{"speculate": "off"}})
	resp, err = http.Post(head.url+"/v1/completions", "application/json", bytes.NewReader(plain))
	if err != nil {
		t.Fatal(err)
	}
	var p struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	json.NewDecoder(resp.Body).Decode(&p)
	resp.Body.Close()
	if len(c.Choices) != 1 || len(p.Choices) != 1 || c.Choices[0].Text != p.Choices[0].Text || c.Choices[0].Text == "" {
		t.Errorf("speculative %q, plain %q", c, p)
	}
	head.stop(t)
}
