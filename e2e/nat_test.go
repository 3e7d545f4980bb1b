package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// natTopo is the issue 29 network, all namespaces made by the test: "pub"
// (the internet: relay, tracker and the head on 198.18.1.254, routing
// between the NATs), two NAT routers masquerading two homes (10.1.0.2
// behind 198.18.1.1, 10.2.0.2 behind 198.18.2.1).
type natTopo struct {
	pub, natA, natB, homeA, homeB string
}

func needNetns(t testing.TB, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: network namespaces need root")
	}
	for _, tool := range append([]string{"ip", "iptables", "curl"}, tools...) {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: no %s (apt-get install iproute2 iptables curl conntrack; .ci/run does)", tool)
		}
	}
	if err := exec.Command("ip", "netns", "list").Run(); err != nil {
		t.Skipf("skipping: ip netns does not work here: %v", err)
	}
}

// newNAT builds the network; symmetric NATs pick a new port per
// destination (MASQUERADE --random-fully), cone-like ones keep it.
func newNAT(t testing.TB, tag string, symmetric bool) natTopo {
	id := fmt.Sprintf("%s%d", tag, os.Getpid()%10000)
	n := natTopo{pub: "mgP" + id, natA: "mgNA" + id, natB: "mgNB" + id, homeA: "mgHA" + id, homeB: "mgHB" + id}
	for _, ns := range []string{n.pub, n.natA, n.natB, n.homeA, n.homeB} {
		must(t, "", "ip", "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		must(t, ns, "ip", "link", "set", "lo", "up")
	}
	link := func(a, aIf, aAddr, b, bIf, bAddr string) {
		must(t, "", "ip", "link", "add", aIf, "netns", a, "type", "veth", "peer", "name", bIf, "netns", b)
		must(t, a, "ip", "addr", "add", aAddr, "dev", aIf)
		must(t, b, "ip", "addr", "add", bAddr, "dev", bIf)
		must(t, a, "ip", "link", "set", aIf, "up")
		must(t, b, "ip", "link", "set", bIf, "up")
	}
	must(t, n.pub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	for i, side := range []struct{ nat, home string }{{n.natA, n.homeA}, {n.natB, n.homeB}} {
		k := i + 1
		link(n.pub, fmt.Sprintf("p%d%s", k, id), fmt.Sprintf("198.18.%d.254/24", k), side.nat, "wan", fmt.Sprintf("198.18.%d.1/24", k))
		link(side.nat, "lan", fmt.Sprintf("10.%d.0.1/24", k), side.home, "eth0", fmt.Sprintf("10.%d.0.2/24", k))
		must(t, side.nat, "ip", "route", "add", "default", "via", fmt.Sprintf("198.18.%d.254", k))
		must(t, side.home, "ip", "route", "add", "default", "via", fmt.Sprintf("10.%d.0.1", k))
		must(t, side.nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
		rule := []string{"iptables", "-t", "nat", "-A", "POSTROUTING", "-s", fmt.Sprintf("10.%d.0.0/24", k), "-o", "wan", "-j", "MASQUERADE"}
		if symmetric {
			rule = append(rule, "--random-fully")
		}
		must(t, side.nat, rule...)
	}
	// The relay's bytes, counted by the kernel.
	must(t, n.pub, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", "7000")
	must(t, n.pub, "iptables", "-A", "OUTPUT", "-p", "tcp", "--sport", "7000")
	return n
}

// relayBytes is what the relay's TCP port took and sent so far.
func (n natTopo) relayBytes(t *testing.T) int64 {
	t.Helper()
	var total int64
	for _, chain := range []string{"INPUT", "OUTPUT"} {
		out, err := netns(n.pub, "iptables", "-L", chain, "-v", "-x", "-n").Output()
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`(?m)^\s*\d+\s+(\d+)\s.*[sd]pt:7000`).FindSubmatch(out)
		if m == nil {
			t.Fatalf("no counter for the relay port in %s:\n%s", chain, out)
		}
		v, _ := strconv.ParseInt(string(m[1]), 10, 64)
		total += v
	}
	return total
}

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
func (l *lockedBuf) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// inNS runs the meshgpu binary in ns until the test ends.
func inNS(t *testing.T, ns string, args ...string) *lockedBuf {
	t.Helper()
	log := &lockedBuf{}
	cmd := netns(ns, append([]string{meshgpuBin}, args...)...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	return log
}

const natTracker = "http://198.18.1.254:7100"

// natMesh starts the relay, tracker and head in pub and a relay-only node
// in each home, and waits until the tracker routes the whole model.
func natMesh(t *testing.T, n natTopo, dir string) (head, mid, tail *lockedBuf) {
	inNS(t, n.pub, "relay", "--listen", "0.0.0.0:7000")
	inNS(t, n.pub, "tracker", "--listen", "0.0.0.0:7100", "--advertise", natTracker)
	relayURL := "ws://198.18.1.254:7000"
	head = inNS(t, n.pub, "run", "--model", dir, "--layers", "0-1", "--listen", "0.0.0.0:7001", "--advertise", "http://198.18.1.254:7001",
		"--tracker", natTracker, "--relay", relayURL)
	mid = inNS(t, n.homeA, "run", "--model", dir, "--layers", "2-3", "--no-listen", "--relay", relayURL, "--tracker", natTracker)
	tail = inNS(t, n.homeB, "run", "--model", dir, "--layers", "4-5", "--no-listen", "--relay", relayURL, "--tracker", natTracker)
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(300 * time.Millisecond) {
		out, _ := netns(n.pub, "curl", "-s", "-m", "2", natTracker+"/map").Output()
		if strings.Contains(string(out), `"covered":true`) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not covered after 90 s: %s\nhead:\n%s\nmid:\n%s\ntail:\n%s", out, tail2(head), tail2(mid), tail2(tail))
		}
	}
}

func tail2(b *lockedBuf) string { return tail(b.String(), 3000) }

func natChat(maxTokens int, stream bool) string {
	b, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "user", "content": "Write a Go function that reverses a string."}},
		"max_tokens": maxTokens, "temperature": 0, "stream": stream})
	return string(b)
}

// chatIn posts a non-streamed chat from ns and returns its text.
func chatIn(t *testing.T, ns, url, body string) string {
	t.Helper()
	out, err := netns(ns, "curl", "-s", "-m", "120", url+"/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body).Output()
	var r struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err != nil || json.Unmarshal(out, &r) != nil || len(r.Choices) != 1 || r.Choices[0].Message.Content == "" {
		t.Fatalf("chat from %s: %v %s", ns, err, out)
	}
	return r.Choices[0].Message.Content
}

// reference is the chat's text from one node holding every layer.
func reference(t *testing.T, n natTopo, dir, body string) string {
	t.Helper()
	inNS(t, n.pub, "run", "--model", dir, "--layers", "0-5", "--listen", "127.0.0.1:7009")
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if out, _ := netns(n.pub, "curl", "-s", "-m", "2", "http://127.0.0.1:7009/health").Output(); strings.Contains(string(out), "layers") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the reference node did not start")
		}
	}
	return chatIn(t, n.pub, "http://127.0.0.1:7009", body)
}

// Issue 29 acceptance, real processes in namespaces with Linux NAT: behind
// cone-like NATs the second 48-token chat moves less than a fifth of the
// relay bytes it moves behind symmetric ones (where the homes cannot
// punch to each other and their hops stay relayed), and every text equals
// one node's. Behind the cone NATs, a UDP rebinding of the middle's NAT
// mid-stream (a new port range and its UDP mappings deleted) leaves the
// stream whole, and the path is punched again afterwards.
func TestDirectPathsThroughNAT(t *testing.T) {
	needNetns(t, "conntrack")
	dir, err := filepath.Abs(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	if meshgpuBin == "" {
		t.Fatalf("no meshgpu binary: %v", buildErr)
	}
	body := natChat(48, false)
	run := func(tag string, symmetric bool, after func(natTopo, *lockedBuf, *lockedBuf, string)) int64 {
		n := newNAT(t, tag, symmetric)
		want := reference(t, n, dir, body)
		head, mid, tail := natMesh(t, n, dir)
		if nodes, _ := netns(n.pub, "curl", "-s", "-m", "2", natTracker+"/nodes").Output(); strings.Count(string(nodes), `"reachability":"relay"`) != 2 ||
			strings.Count(string(nodes), `"reachability":"public"`) != 1 {
			t.Fatalf("/nodes does not show the head public and the homes behind the relay: %s", nodes)
		}
		if got := chatIn(t, n.pub, natTracker, body); got != want {
			t.Fatalf("%s, first chat: %q, want one node's %q", tag, got, want)
		}
		time.Sleep(10 * time.Second) // punching (or giving up) between the chats
		before := n.relayBytes(t)
		if got := chatIn(t, n.pub, natTracker, body); got != want {
			t.Fatalf("%s, second chat: %q, want one node's %q\nmid:\n%s", tag, got, want, tail2(mid))
		}
		moved := n.relayBytes(t) - before
		t.Logf("%s NATs: the second chat moved %d relay bytes; paths proven: head %d (%d TCP), mid %d (%d TCP), tail %d", tag, moved,
			strings.Count(head.String(), "direct path proven"), len(tcpProven.FindAllString(head.String(), -1)),
			strings.Count(mid.String(), "direct path proven"), len(tcpProven.FindAllString(mid.String(), -1)), strings.Count(tail.String(), "direct path proven"))
		// Behind cone NATs the middle's hops to the tail take the punched
		// TCP path; behind symmetric ones no TCP punch can meet.
		if tcp := len(tcpProven.FindAllString(mid.String(), -1)); symmetric != (tcp == 0) {
			t.Fatalf("%s NATs: %d punched TCP paths from the middle to the tail\nmid:\n%s", tag, tcp, tail2(mid))
		}
		if after != nil {
			after(n, head, mid, want)
		}
		return moved
	}
	sym := run("s", true, nil)
	cone := run("c", false, func(n natTopo, head, mid *lockedBuf, _ string) {
		// Rebinding: the middle's NAT maps UDP to another port (one for
		// all, so it stays cone-like) and forgets
		// its UDP mappings, in the middle of a stream.
		long := natChat(96, true)
		want := reference2(t, n, long)
		cmd := netns(n.pub, "curl", "-sN", "-m", "120", natTracker+"/v1/chat/completions", "-H", "Content-Type: application/json", "-d", long)
		out, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(out)
		var text strings.Builder
		chunks := 0
		for sc.Scan() {
			line := strings.TrimPrefix(sc.Text(), "data: ")
			var ev struct {
				Choices []struct {
					Delta struct{ Content string } `json:"delta"`
				} `json:"choices"`
			}
			if json.Unmarshal([]byte(line), &ev) == nil && len(ev.Choices) > 0 {
				text.WriteString(ev.Choices[0].Delta.Content)
				if chunks++; chunks == 8 {
					must(t, n.natA, "iptables", "-t", "nat", "-I", "POSTROUTING", "-p", "udp", "-s", "10.1.0.0/24", "-o", "wan", "-j", "MASQUERADE", "--to-ports", "40000")
					must(t, n.natA, "conntrack", "-D", "-p", "udp")
					// The punched TCP paths' mappings too (the relay's
					// and tracker's connections stay: they are the fallback).
					must(t, n.natA, "iptables", "-t", "nat", "-I", "POSTROUTING", "-p", "tcp", "-s", "10.1.0.0/24", "-o", "wan",
						"-m", "multiport", "!", "--dports", "7000,7100", "-j", "MASQUERADE", "--to-ports", "40000-40999")
					flushTCPMappings(t, n.natA, "7000", "7100")
				}
			}
		}
		cmd.Wait()
		if chunks <= 8 || text.String() != want {
			t.Fatalf("stream across the rebinding: %d chunks, %q, want %q\nhead:\n%s\nmid:\n%s", chunks, text.String(), want, tail2(head), tail2(mid))
		}
		lost := strings.Count(head.String(), "direct path lost") + strings.Count(mid.String(), "direct path lost")
		// Up to a minute and a half: a path between two NATs comes back once
		// the rebinding's stale conntrack flows expire (node/directpath.go).
		for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(2 * time.Second) {
			chatIn(t, n.pub, natTracker, body)
			before := n.relayBytes(t)
			chatIn(t, n.pub, natTracker, body)
			moved := n.relayBytes(t) - before
			if moved < 20000 {
				t.Logf("after the rebinding (%d paths lost): a chat moved %d relay bytes", lost, moved)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no direct path 90 s after the rebinding: a chat moved %d relay bytes\nhead:\n%s\nmid:\n%s", moved, tail2(head), tail2(mid))
			}
		}
	})
	if cone*5 >= sym {
		t.Fatalf("the second chat moved %d relay bytes behind cone NATs and %d behind symmetric ones: want less than a fifth", cone, sym)
	}
}

// reference2 is reference on the already running node of port 7009, for a
// streamed body (asked unstreamed: the same text).
// tcpProven matches what a node logs when a punched TCP path is proven.
var tcpProven = regexp.MustCompile(`direct path proven[^\n]* path=direct-tcp `)

// flushTCPMappings deletes ns's TCP conntrack entries but those to the
// keep ports.
func flushTCPMappings(t *testing.T, ns string, keep ...string) {
	t.Helper()
	out, err := netns(ns, "conntrack", "-L", "-p", "tcp").Output()
	if err != nil {
		t.Fatal(err)
	}
	field := regexp.MustCompile(`src=(\S+) dst=(\S+) sport=(\d+) dport=(\d+)`)
	for _, line := range strings.Split(string(out), "\n") {
		m := field.FindStringSubmatch(line)
		if m == nil || slices.Contains(keep, m[4]) {
			continue
		}
		netns(ns, "conntrack", "-D", "-p", "tcp", "-s", m[1], "-d", m[2], "--sport", m[3], "--dport", m[4]).Run()
	}
}

func reference2(t *testing.T, n natTopo, streamed string) string {
	var m map[string]any
	json.Unmarshal([]byte(streamed), &m)
	m["stream"] = false
	b, _ := json.Marshal(m)
	return chatIn(t, n.pub, "http://127.0.0.1:7009", string(b))
}
