package daemon

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}

// Slowloris on a node's port (the TLS/plain sniffer used to clear the
// server's header deadline once the first byte came): 20 connections that
// send one byte (0x16, a TLS record's first) or trickle a request line a
// byte at a time are all closed by the node within its header deadline,
// the node keeps answering, and no goroutine or descriptor is left.
func TestStalledConnectionsClosedWithinHeaderDeadline(t *testing.T) {
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
	if err != nil {
		t.Fatal(err)
	}
	const deadline = 600 * time.Millisecond
	n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, First: 0, Last: 5,
		MaxSessions: 1, MaxContext: 32, HeaderTimeout: deadline, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	addr := strings.TrimPrefix(n.URL(), "http://")
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	health := func() {
		t.Helper()
		resp, err := hc.Get(n.URL() + "/health")
		if err != nil {
			t.Fatalf("/health during the attack: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("/health during the attack: HTTP %d", resp.StatusCode)
		}
	}
	health()
	testenv.CheckGoroutines(t)
	fds := openFDs(t)

	// Without the deadline a connection would stay open for as long as
	// the attacker likes; the test gives up on it well after the deadline.
	const giveUp = 5 * time.Second
	const conns = 20
	var wg sync.WaitGroup
	held := make([]time.Duration, conns)
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		stop := make(chan struct{})
		wg.Add(2)
		go func() { // the attacker: one byte, or a request line a byte every 100 ms
			defer wg.Done()
			line := []byte("GET /health HTTP/1.1\r\nHost: x\r\n")
			if i%2 == 0 {
				line = []byte{0x16}
			}
			for k, b := range line {
				if k > 0 {
					select {
					case <-stop:
						return
					case <-time.After(100 * time.Millisecond):
					}
				}
				if _, err := c.Write([]byte{b}); err != nil {
					return
				}
			}
		}()
		go func() { // waits for the node to close the connection
			defer wg.Done()
			defer close(stop)
			defer c.Close()
			c.SetReadDeadline(start.Add(giveUp))
			_, err := io.Copy(io.Discard, c)
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				held[i] = -1
				return
			}
			held[i] = time.Since(start)
		}()
	}
	health() // the node serves others meanwhile
	wg.Wait()
	for i, d := range held {
		kind := "one byte 0x16"
		if i%2 == 1 {
			kind = "trickled request line"
		}
		if d < 0 {
			t.Errorf("connection %d (%s): still open after %v; the header deadline is %v", i, kind, giveUp, deadline)
		} else if d > giveUp/2 { // closed, not held: 40 goroutines on a loaded runner take their time
			t.Errorf("connection %d (%s): closed after %v; the header deadline is %v", i, kind, d, deadline)
		}
	}
	health()
	// Descriptors: the 20 sockets are gone on both ends (a little slack
	// for the runtime's own, e.g. the health check's connection closing).
	var after int
	for end := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if after = openFDs(t); after <= fds+2 || time.Now().After(end) {
			break
		}
	}
	if after > fds+2 {
		t.Errorf("open descriptors: %d before the attack, %d after", fds, after)
	}
}
