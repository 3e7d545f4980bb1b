package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// guideBlocks returns the shell blocks of docs/deploy.md tagged
// <!-- deploy-test: NAME --> (the line before the fence), by name.
func guideBlocks(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "docs", "deploy.md"))
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile("(?s)<!-- deploy-test: (\\w+) -->\n```sh\n(.*?)```")
	out := map[string]string{}
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		out[m[1]] = m[2]
	}
	for _, name := range []string{"a", "b", "client"} {
		if out[name] == "" {
			t.Fatalf("docs/deploy.md has no block tagged deploy-test: %s", name)
		}
	}
	return out
}

// netns runs a command line in namespace ns (or the root one for "").
func netns(ns string, args ...string) *exec.Cmd {
	if ns == "" {
		return exec.Command(args[0], args[1:]...)
	}
	return exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
}

func must(t testing.TB, ns string, args ...string) {
	t.Helper()
	if out, err := netns(ns, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", ns, args, err, out)
	}
}

// Issue 30: a newcomer follows docs/deploy.md on two machines, one behind
// NAT, and gets a streamed chat. The machines are network namespaces: A
// has the public address 198.18.0.2 (the benchmarking range, which the
// tracker treats as public), B has 10.77.0.2 behind a router namespace
// that masquerades it onto 198.18.0.1, so A cannot open a connection to B.
// The guide's tagged blocks run as written, with its variables set.
func TestDeployGuideOnTwoNamespaces(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: network namespaces need root")
	}
	for _, tool := range []string{"ip", "iptables", "curl", "bash"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: no %s (apt-get install iproute2 iptables curl; .ci/run does)", tool)
		}
	}
	if err := exec.Command("ip", "netns", "list").Run(); err != nil {
		t.Skipf("skipping: ip netns does not work here: %v", err)
	}
	dir, err := filepath.Abs(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	if meshgpuBin == "" {
		t.Fatalf("no meshgpu binary: %v", buildErr)
	}
	blocks := guideBlocks(t)

	// The network: A -- router -- (NAT) -- B.
	id := os.Getpid() % 100000
	nsA, nsB, nsR := fmt.Sprintf("mgA%d", id), fmt.Sprintf("mgB%d", id), fmt.Sprintf("mgR%d", id)
	va, ra, vb, rb := fmt.Sprintf("va%d", id), fmt.Sprintf("ra%d", id), fmt.Sprintf("vb%d", id), fmt.Sprintf("rb%d", id)
	for _, ns := range []string{nsA, nsB, nsR} {
		must(t, "", "ip", "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		must(t, ns, "ip", "link", "set", "lo", "up")
	}
	must(t, "", "ip", "link", "add", va, "type", "veth", "peer", "name", ra)
	must(t, "", "ip", "link", "set", va, "netns", nsA)
	must(t, "", "ip", "link", "set", ra, "netns", nsR)
	must(t, "", "ip", "link", "add", vb, "type", "veth", "peer", "name", rb)
	must(t, "", "ip", "link", "set", vb, "netns", nsB)
	must(t, "", "ip", "link", "set", rb, "netns", nsR)
	must(t, nsA, "ip", "addr", "add", "198.18.0.2/24", "dev", va)
	must(t, nsA, "ip", "link", "set", va, "up")
	must(t, nsR, "ip", "addr", "add", "198.18.0.1/24", "dev", ra)
	must(t, nsR, "ip", "addr", "add", "10.77.0.1/24", "dev", rb)
	must(t, nsR, "ip", "link", "set", ra, "up")
	must(t, nsR, "ip", "link", "set", rb, "up")
	must(t, nsR, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	must(t, nsR, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "10.77.0.0/24", "-o", ra, "-j", "MASQUERADE")
	must(t, nsB, "ip", "addr", "add", "10.77.0.2/24", "dev", vb)
	must(t, nsB, "ip", "link", "set", vb, "up")
	must(t, nsB, "ip", "route", "add", "default", "via", "10.77.0.1")
	// A has no way to B: B is behind the NAT (checked again at the end:
	// B's connections went through the masquerade).
	if out, err := netns(nsA, "ip", "route", "get", "10.77.0.2").CombinedOutput(); err == nil {
		t.Fatalf("machine A has a route to B behind the NAT: %s", out)
	}

	env := []string{"PATH=" + filepath.Dir(meshgpuBin) + ":" + os.Getenv("PATH"), "PUBLIC_IP=198.18.0.2", "MODEL=" + dir,
		"HEAD_LAYERS=0-2", "TAIL_LAYERS=3-5", "API_KEY=deploy-test-key"}
	machine := func(name, ns, block string) *bytes.Buffer {
		var log bytes.Buffer
		cmd := netns(ns, "bash", "-c", "set -e\n"+block+"\nwait")
		cmd.Env = append(append(os.Environ(), env...), "HOME="+t.TempDir())
		cmd.Stdout, cmd.Stderr = &log, &log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			cmd.Wait()
		})
		return &log
	}
	logA := machine("A", nsA, blocks["a"])
	logB := machine("B", nsB, blocks["b"])
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		out, _ := netns(nsR, "curl", "-s", "-m", "2", "http://198.18.0.2:7100/map").Output()
		if strings.Contains(string(out), `"covered":true`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the mesh is not covered 60 s after the guide's commands:\n/map: %s\nmachine A:\n%s\nmachine B:\n%s", out, tail(logA.String(), 3000), tail(logB.String(), 3000))
		}
	}
	nodes, _ := netns(nsR, "curl", "-s", "-m", "2", "http://198.18.0.2:7100/nodes").Output()
	if !strings.Contains(string(nodes), `"relay_addr":"ws://198.18.0.2:7000/rpc/`) {
		t.Fatalf("the tail is not registered through the relay: %s", nodes)
	}
	// The client, "from anywhere": the router's side of the internet.
	cmd := netns(nsR, "bash", "-c", blocks["client"])
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "data: ") || !strings.Contains(string(out), "data: [DONE]") || !strings.Contains(string(out), `"content":`) {
		t.Fatalf("the guide's chat: %v\n%s\nmachine A:\n%s\nmachine B:\n%s", err, out, tail(logA.String(), 3000), tail(logB.String(), 3000))
	}
	chunks := strings.Count(string(out), "data: {")
	t.Logf("streamed chat through the guide's mesh: %d chunks", chunks)
	nat, _ := netns(nsR, "iptables", "-t", "nat", "-L", "POSTROUTING", "-v", "-n", "-x").Output()
	if m := regexp.MustCompile(`(?m)^\s*(\d+)\s+\d+\s+MASQUERADE`).FindStringSubmatch(string(nat)); m == nil || m[1] == "0" {
		t.Fatalf("B's traffic did not go through the NAT:\n%s", nat)
	}
	// Without the key, the tracker refuses.
	bad := netns(nsR, "curl", "-s", "-m", "5", "http://198.18.0.2:7100/v1/models")
	if b, _ := bad.Output(); !strings.Contains(string(b), "invalid_api_key") {
		t.Fatalf("/v1/models without the key: %s", b)
	}
}
