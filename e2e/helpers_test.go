// Package e2e holds the end-to-end tests of a whole mesh on 127.0.0.1:
// nodes, relay and tracker, in-process (through package daemon) and as
// separate `meshgpu` processes (the binary TestMain builds).
package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/relay"
)

// meshgpuBin is the binary TestMain built ("" when the build failed; the
// tests that exec it then fail with buildErr).
var (
	meshgpuBin string
	buildErr   error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "meshgpu-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	bin := filepath.Join(dir, "meshgpu")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/meshgpu")
	cmd.Dir = testenv.RepoRoot()
	if out, err := cmd.CombinedOutput(); err != nil {
		buildErr = fmt.Errorf("go build ./cmd/meshgpu: %v\n%s", err, out)
	} else {
		meshgpuBin = bin
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// newHTTPClient is a client whose idle connections are closed at cleanup.
func newHTTPClient(t *testing.T) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 8, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 60 * time.Second}
}

func newIdentity(t *testing.T) *identity.Identity {
	id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "node.key"))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// startRelay runs a relay hub on 127.0.0.1 and returns its ws:// base.
func startRelay(t *testing.T) (string, *httptest.Server) {
	srv := &relay.Server{Logger: quietLogger()}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		srv.Close()
		hs.Close()
	})
	return "ws://" + strings.TrimPrefix(hs.URL, "http://"), hs
}

// stream is a parsed SSE answer.
type stream struct {
	text    string
	ids     []int32
	done    bool   // [DONE] seen
	err     string // an error event
	errType string // its type
}

// readSSE reads OpenAI stream chunks (completions or chat) until [DONE],
// an error event, or EOF.
func readSSE(t *testing.T, r io.Reader) stream {
	t.Helper()
	var s stream
	var text strings.Builder
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			s.done = true
			break
		}
		var c struct {
			Choices []struct {
				Text  *string `json:"text"`
				Delta *struct {
					Content *string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Meshgpu *struct {
				Token int32 `json:"token"`
			} `json:"meshgpu"`
			Error *struct {
				Message string `json:"message"`
				Type    string `json:"type"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("bad SSE event %q: %v", data, err)
		}
		if c.Error != nil {
			s.err, s.errType = c.Error.Message, c.Error.Type
			break
		}
		for _, ch := range c.Choices {
			if ch.Text != nil {
				text.WriteString(*ch.Text)
			}
			if ch.Delta != nil && ch.Delta.Content != nil {
				text.WriteString(*ch.Delta.Content)
			}
		}
		if c.Meshgpu != nil {
			s.ids = append(s.ids, c.Meshgpu.Token)
		}
	}
	s.text = text.String()
	return s
}

// postStream posts body to url and parses the SSE answer.
func postStream(t *testing.T, hc *http.Client, url string, body any) stream {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := hc.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		msg, _ := io.ReadAll(resp.Body)
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, msg)
	}
	return readSSE(t, resp.Body)
}

// relayRequests reads meshgpu_relay_requests_total{path,result="ok"} from a
// relay's /metrics.
func relayRequests(t *testing.T, hc *http.Client, base, path string) float64 {
	t.Helper()
	resp, err := hc.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	return metric(t, resp.Body, fmt.Sprintf(`meshgpu_relay_requests_total{path=%q,result="ok"}`, path))
}

// metric finds one sample (name with its labels, as exposed) in a
// Prometheus text body; 0 when absent.
func metric(t *testing.T, r io.Reader, series string) float64 {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			var v float64
			if _, err := fmt.Sscanf(rest, "%g", &v); err == nil {
				return v
			}
		}
	}
	return 0
}

// proc is a `meshgpu` child process whose stderr is kept and scanned.
type proc struct {
	name   string
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	exited chan struct{}
}

// startProc runs the built binary with args and waits for a stderr line
// matching ready; it returns the first submatch of that line.
func startProc(t *testing.T, name string, ready *regexp.Regexp, args ...string) (*proc, string) {
	t.Helper()
	return startProcEnv(t, name, ready, nil, args...)
}

// startProcEnv is startProc with env added to the test's environment.
func startProcEnv(t *testing.T, name string, ready *regexp.Regexp, env []string, args ...string) (*proc, string) {
	t.Helper()
	if meshgpuBin == "" {
		t.Fatalf("no meshgpu binary: %v", buildErr)
	}
	cmd := exec.Command(meshgpuBin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	pr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, exited: make(chan struct{})}
	found := make(chan string, 1)
	go func() {
		defer close(p.exited)
		sc := bufio.NewScanner(pr)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.stderr.WriteString(line + "\n")
			p.mu.Unlock()
			if m := ready.FindStringSubmatch(line); m != nil && !sent {
				sent = true
				found <- m[len(m)-1]
			}
		}
		io.Copy(io.Discard, pr)
		cmd.Wait()
	}()
	t.Cleanup(func() { p.kill() })
	select {
	case v := <-found:
		return p, v
	case <-p.exited:
		t.Fatalf("%s exited before it was ready:\n%s", name, p.log())
	case <-time.After(60 * time.Second):
		t.Fatalf("%s not ready after 60s:\n%s", name, p.log())
	}
	return nil, ""
}

func (p *proc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// kill ends the process at once (SIGKILL) and waits for it.
func (p *proc) kill() {
	p.cmd.Process.Kill()
	<-p.exited
}

// quietLogger keeps in-process servers' logs out of the test output unless
// MESHGPU_E2E_LOG is set.
func quietLogger() *slog.Logger {
	if os.Getenv("MESHGPU_E2E_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// streamAfter posts body to url (a streamed completion) and reads its
// first n data events; the returned reader replays them and continues the
// stream (closed at the test's end).
func streamAfter(t *testing.T, hc *http.Client, url string, body any, n int) io.Reader {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := hc.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		msg, _ := io.ReadAll(resp.Body)
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, msg)
	}
	br := bufio.NewReader(resp.Body)
	var seen bytes.Buffer
	for chunks := 0; chunks < n; {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended after %d chunks: %v\n%s", chunks, err, seen.String())
		}
		seen.WriteString(line)
		if strings.HasPrefix(line, "data: ") {
			chunks++
		}
	}
	return io.MultiReader(&seen, br)
}

// modelCopy makes a directory named like src (so its nodes register as the
// same model) whose files link to src's, except the skipped ones, which the
// caller writes.
func modelCopy(t *testing.T, src string, skip ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), filepath.Base(src))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() || slices.Contains(skip, e.Name()) {
			continue
		}
		if err := os.Symlink(filepath.Join(src, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
