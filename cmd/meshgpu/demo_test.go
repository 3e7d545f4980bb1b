package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"meshgpu/demo"
	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/native"
)

// oneNodeAnswer is the single-node reference for the demo's request:
// engine.Generate over the chat template's rendering of the default prompt,
// greedy, the default token limit.
func oneNodeAnswer(t *testing.T, dir string) *engine.Result {
	t.Helper()
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	text, err := m.Template.Render([]chat.Message{{Role: "user", Content: demo.DefaultPrompt}}, true)
	if err != nil {
		t.Fatal(err)
	}
	res, err := m.Generate(context.Background(), m.Tokenizer.Encode(text, false), engine.GenerateParams{MaxTokens: demo.DefaultMaxTokens}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.IDs) == 0 {
		t.Fatal("the reference generated nothing")
	}
	return res
}

// `make demo`'s entry point, headless: `meshgpu demo --once` with
// MESHGPU_MODEL naming an empty directory synthesizes the tiny model there,
// prints the three nodes (one behind the relay), streams an answer equal to
// one node's on that model, and exits 0.
func TestDemoCommandOnceSynthesized(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tiny")
	cmd := meshgpuCmd([]string{"MESHGPU_MODEL=" + dir}, "demo", "--once", "--backend", "cpu", "--threads", "1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("meshgpu demo --once: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	ref := oneNodeAnswer(t, dir)
	out := stdout.String()
	for _, want := range []string{"layers 0-1", "layers 2-3", "layers 4-5  no listener, reachable only through the relay: ws://127.0.0.1:",
		"\n\n" + ref.Text + "\n\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
}

// MESHGPU_CPU_ISA (--cpu-isa) reaches the backend the demo opens.
func TestDemoCPUISA(t *testing.T) {
	isa, runs := isaProbe()
	dir := filepath.Join(t.TempDir(), "tiny")
	cmd := meshgpuCmd([]string{"MESHGPU_MODEL=" + dir, "MESHGPU_CPU_ISA=" + isa}, "demo", "--once", "--backend", "cpu", "--threads", "1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	code := 0
	if err := cmd.Run(); err != nil {
		code = 1
	}
	checkISA(t, "demo", isa, runs, stdout.String(), stderr.String(), code)
}

// Ctrl-C (SIGINT) while the demo serves stops it: exit 0 within seconds.
func TestDemoCommandStopsOnSIGINT(t *testing.T) {
	dir := testenv.GoCoder(t)
	cmd := meshgpuCmd(nil, "demo", "--model", dir, "--backend", "cpu", "--threads", "1")
	pr, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	var mu sync.Mutex
	var out strings.Builder
	serving := make(chan struct{})
	exited := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		once := sync.Once{}
		for sc.Scan() {
			mu.Lock()
			out.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if strings.Contains(sc.Text(), "Press Ctrl-C") {
				once.Do(func() { close(serving) })
			}
		}
		io.Copy(io.Discard, pr)
		exited <- cmd.Wait()
	}()
	output := func() string { mu.Lock(); defer mu.Unlock(); return out.String() }
	select {
	case <-serving:
	case err := <-exited:
		t.Fatalf("demo exited (%v) before serving:\n%s\n%s", err, output(), stderr.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("demo not serving after 60 s:\n%s", output())
	}
	cmd.Process.Signal(syscall.SIGINT)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("exit %v after SIGINT:\n%s\n%s", err, output(), stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("no exit 20 s after SIGINT:\n%s", output())
	}
	if !strings.Contains(output(), "stopping") {
		t.Errorf("no stopping line:\n%s", output())
	}
}

// Bad flags exit 1 with one line naming what to fix; a directory holding
// something else is not touched.
func TestDemoCommandBadFlags(t *testing.T) {
	junk := t.TempDir()
	if err := os.WriteFile(filepath.Join(junk, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--base-port", "70000"}, "--base-port"},
		{[]string{"--max-tokens", "0"}, "--max-tokens"},
		{[]string{"--hop-dtype", "int8"}, "--hop-dtype"},
		{[]string{"--threads", "-2"}, "--threads"},
		{[]string{"hello"}, "--prompt"},
		{[]string{"--model", junk, "--once"}, "config.json"},
	} {
		cmd := meshgpuCmd(nil, append([]string{"demo"}, tc.args...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
		last := lines[len(lines)-1]
		if code != 1 || !strings.HasPrefix(last, "meshgpu: ") || !strings.Contains(last, tc.want) {
			t.Errorf("demo %v: exit %d, stderr %q; want exit 1 naming %s", tc.args, code, stderr.String(), tc.want)
		}
	}
	if ents, _ := os.ReadDir(junk); len(ents) != 1 {
		t.Errorf("the non-model directory now holds %d entries", len(ents))
	}
}

// Off a terminal the progress is plain log lines: one every 2 s of a pass
// and one when a pass that took a second or more ends; a quick pass (each
// engine.Load is one) logs nothing.
func TestProgressPlainLines(t *testing.T) {
	var buf bytes.Buffer
	clock := time.Unix(0, 0)
	p := &progress{what: "loading", log: slog.New(slog.NewTextHandler(&buf, nil)), now: func() time.Time { return clock }}
	// A slow pass: 10 steps of 500 ms from its first report: lines 2 s and
	// 4 s after it (50%, 90%), and at its end.
	for done := int64(10); done <= 100; done += 10 {
		clock = clock.Add(500 * time.Millisecond)
		p.Update(done, 100)
	}
	// A quick pass of another load: nothing.
	for done := int64(5); done <= 50; done += 5 {
		clock = clock.Add(time.Millisecond)
		p.Update(done, 50)
	}
	p.Finish()
	got := buf.String()
	if n := strings.Count(got, "msg=loading"); n != 3 || !strings.Contains(got, "percent=50") || !strings.Contains(got, "percent=90") ||
		strings.Count(got, "percent=100") != 1 || strings.Contains(got, "total_bytes=50 ") {
		t.Errorf("%d lines; want 50%%, 90%% and 100%% of the slow pass only:\n%s", n, got)
	}
}

// On a terminal the progress is a bar per pass, each ending its line; an
// unfinished pass (a failed load) ends its line too.
func TestProgressBar(t *testing.T) {
	var buf bytes.Buffer
	p := &progress{what: "loading gocoder-6m", tty: &buf, log: slog.New(slog.NewTextHandler(io.Discard, nil)), now: time.Now}
	p.Update(1<<20, 4<<20)
	p.Update(4<<20, 4<<20)
	p.Update(1<<20, 2<<20) // second pass, cut short
	p.Finish()
	got := buf.String()
	if !strings.Contains(got, "loading gocoder-6m") || !strings.Contains(got, "100%") || !strings.Contains(got, "50%") ||
		strings.Count(got, "\n") != 2 || !strings.HasSuffix(got, "\n") {
		t.Errorf("bar output %q; want two bars (100%%, then 50%%), each ending its line", got)
	}
}
