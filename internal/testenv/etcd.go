package testenv

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"
)

// EtcdBinary is Debian's etcd-server (.ci/run installs it).
const EtcdBinary = "/usr/bin/etcd"

// Etcd runs a one-member etcd on 127.0.0.1 with free ports and a temporary
// data directory until the test ends, and returns its client address
// (host:port). Without the etcd binary the test is skipped (failed under CI).
func Etcd(t testing.TB) string {
	t.Helper()
	NeedTool(t, EtcdBinary, "apt-get install etcd-server")
	client, peer := freePort(t), freePort(t)
	dir := etcdDataDir(t)
	cmd := exec.Command(EtcdBinary, "--name", "test", "--data-dir", dir,
		"--listen-client-urls", "http://"+client, "--advertise-client-urls", "http://"+client,
		"--listen-peer-urls", "http://"+peer, "--initial-advertise-peer-urls", "http://"+peer,
		"--initial-cluster", "test=http://"+peer, "--log-level", "warn")
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting etcd: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: time.Second}
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := hc.Get("http://" + client + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return client
			}
		}
		select {
		case <-exited:
			t.Fatalf("etcd exited:\n%s", out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd not healthy after 20s:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func freePort(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return fmt.Sprintf("127.0.0.1:%d", ln.Addr().(*net.TCPAddr).Port)
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// etcdDataDir is a fresh directory in memory (/dev/shm) where there is one:
// etcd fsyncs its log on every write, and on a disk busy with other tests'
// writes (the image builds) one fsync can stall past a test's heartbeat
// timeout, expiring nodes that are alive. Tests never need etcd's data to
// outlive the process.
func etcdDataDir(t testing.TB) string {
	dir, err := os.MkdirTemp("/dev/shm", "meshgpu-etcd-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
