package e2e

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/internal/testenv"
)

// chromiumBinary is Debian's chromium (.ci/run installs it).
const chromiumBinary = "/usr/bin/chromium"

// browser is a headless Chromium driven over the DevTools protocol: one
// page target, commands sent as JSON over its WebSocket.
type browser struct {
	t    *testing.T
	cmd  *exec.Cmd
	conn *websocket.Conn
	mu   sync.Mutex
	id   int
}

// startBrowser runs headless Chromium with a fresh profile until the test
// ends; without chromium it skips the test (fails under CI).
func startBrowser(t *testing.T) *browser {
	t.Helper()
	testenv.NeedTool(t, chromiumBinary, "apt-get install chromium")
	// Without the background-networking flags Chromium dials out, and this
	// machine's closed network refuses it.
	cmd := exec.Command(chromiumBinary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
		"--disable-dev-shm-usage", "--window-size=1200,900", "--user-data-dir="+t.TempDir(), "--remote-debugging-address=127.0.0.1",
		"--remote-debugging-port=0", "about:blank")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	wsURL := make(chan string, 1)
	go func() {
		defer close(exited)
		sc := bufio.NewScanner(stderr)
		re := regexp.MustCompile(`DevTools listening on (ws://\S+)`)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case wsURL <- m[1]:
				default:
				}
			}
		}
		cmd.Wait()
	}()
	b := &browser{t: t, cmd: cmd}
	t.Cleanup(func() {
		if b.conn != nil {
			b.conn.Close()
		}
		cmd.Process.Kill()
		<-exited
	})
	var browserWS string
	select {
	case browserWS = <-wsURL:
	case <-exited:
		t.Fatal("chromium exited before its DevTools endpoint was up")
	case <-time.After(30 * time.Second):
		t.Fatal("chromium: no DevTools endpoint after 30s")
	}
	// The page target of about:blank, from the HTTP side of the endpoint.
	host := strings.SplitN(strings.TrimPrefix(browserWS, "ws://"), "/", 2)[0]
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get("http://" + host + "/json/list")
	if err != nil {
		t.Fatal(err)
	}
	var targets []struct{ Type, WebSocketDebuggerURL string }
	err = json.NewDecoder(resp.Body).Decode(&targets)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, tg := range targets {
		if tg.Type == "page" {
			if b.conn, _, err = websocket.DefaultDialer.Dial(tg.WebSocketDebuggerURL, nil); err != nil {
				t.Fatal(err)
			}
			return b
		}
	}
	t.Fatalf("chromium has no page target: %+v", targets)
	return nil
}

// call sends one DevTools command and returns its result, skipping the
// events that arrive meanwhile.
func (b *browser) call(method string, params any, result any) {
	b.t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.id++
	id := b.id
	b.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if err := b.conn.WriteJSON(map[string]any{"id": id, "method": method, "params": params}); err != nil {
		b.t.Fatalf("devtools %s: %v", method, err)
	}
	for {
		b.conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		var msg struct {
			ID     int             `json:"id"`
			Result json.RawMessage `json:"result"`
			Error  *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := b.conn.ReadJSON(&msg); err != nil {
			b.t.Fatalf("devtools %s: %v", method, err)
		}
		if msg.ID != id {
			continue
		}
		if msg.Error != nil {
			b.t.Fatalf("devtools %s: %s", method, msg.Error.Message)
		}
		if result != nil {
			if err := json.Unmarshal(msg.Result, result); err != nil {
				b.t.Fatalf("devtools %s: %v", method, err)
			}
		}
		return
	}
}

func (b *browser) navigate(url string) {
	b.call("Page.navigate", map[string]any{"url": url}, nil)
}

// eval runs a JavaScript expression in the page and decodes its value.
func (b *browser) eval(expr string, out any) {
	b.t.Helper()
	var r struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text string `json:"text"`
		} `json:"exceptionDetails"`
	}
	b.call("Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true}, &r)
	if r.ExceptionDetails != nil {
		b.t.Fatalf("eval %s: %s", expr, r.ExceptionDetails.Text)
	}
	if out != nil && len(r.Result.Value) > 0 {
		if err := json.Unmarshal(r.Result.Value, out); err != nil {
			b.t.Fatalf("eval %s: %v (%s)", expr, err, r.Result.Value)
		}
	}
}

// screenshot writes a PNG of the page to path.
func (b *browser) screenshot(path string) {
	b.t.Helper()
	var r struct{ Data string }
	b.call("Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true}, &r)
	png, err := base64.StdEncoding.DecodeString(r.Data)
	if err != nil {
		b.t.Fatal(err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
}

// waitEval polls expr until it is true.
func (b *browser) waitEval(what, expr string, within time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(within)
	for {
		var ok bool
		b.eval(expr, &ok)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			var html string
			b.eval("document.body.innerText", &html)
			b.t.Fatalf("page: %s not within %v; page text:\n%s", what, within, html)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
