package main

import (
	"bufio"
	"encoding/json"
	"net/http"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestRelayCommandServesAndStopsOnSIGTERM(t *testing.T) {
	cmd := meshgpuCmd(nil, "relay", "--listen", "127.0.0.1:0", "--join-token", "tok")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	addrc := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`addr=(127\.0\.0\.1:\d+)`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				addrc <- m[1]
			}
		}
	}()
	var addr string
	select {
	case addr = <-addrc:
	case <-time.After(20 * time.Second):
		t.Fatal("relay did not log its address")
	}
	resp, err := http.Get("http://" + addr + "/health")
	if err != nil {
		t.Fatal(err)
	}
	var h map[string]any
	json.NewDecoder(resp.Body).Decode(&h)
	resp.Body.Close()
	if resp.StatusCode != 200 || h["status"] != "ok" {
		t.Fatalf("health: %d %v", resp.StatusCode, h)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("relay exited with %v after SIGTERM, want 0", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("relay did not stop after SIGTERM")
	}
}

func TestRelayCommandRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"relay", "--tls-cert", "c.pem"},
		{"relay", "--max-frame-bytes", "10"},
		{"relay", "--max-inflight-per-peer", "0"},
		{"relay", "--listen", "127.0.0.1:99999"},
	} {
		out, err := meshgpuCmd(nil, args...).CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 1 {
			t.Fatalf("%v: exit %v, want 1\n%s", args, err, out)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if last := lines[len(lines)-1]; !strings.HasPrefix(last, "meshgpu: --") {
			t.Fatalf("%v: last line %q should name the flag to fix", args, last)
		}
	}
}
