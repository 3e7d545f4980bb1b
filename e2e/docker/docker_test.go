// Package docker_test runs the images `make docker-test` builds
// (scripts/docker-test.sh: meshgpu:cpu from Dockerfile, meshgpu from
// Dockerfile.cuda): a node in a container with the test model mounted
// read-only and its key on a named volume answers a chat completion on
// 127.0.0.1, keeps its peer id across a restart and a new container, is
// healthy by its own HEALTHCHECK, downloads --model org/name into the
// volume, and `demo --once` and `--version` work. The containers use
// --network host (dockerd runs with --bridge=none) or none; nothing
// listens beyond 127.0.0.1.
//
// The tests skip unless MESHGPU_DOCKER_TEST=1 (set by the script, which
// builds the images first); then a missing docker fails them.
package docker_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// image is one image under test.
type image struct {
	tag  string
	cuda bool // built from Dockerfile.cuda
}

// images are $MESHGPU_DOCKER_CPU_IMAGE (default meshgpu:cpu) and
// $MESHGPU_DOCKER_CUDA_IMAGE (default meshgpu; "-": not built here).
func images() []image {
	cpu, cuda := os.Getenv("MESHGPU_DOCKER_CPU_IMAGE"), os.Getenv("MESHGPU_DOCKER_CUDA_IMAGE")
	if cpu == "" {
		cpu = "meshgpu:cpu"
	}
	if cuda == "" {
		cuda = "meshgpu"
	}
	out := []image{{tag: cpu}}
	if cuda != "-" {
		out = append(out, image{tag: cuda, cuda: true})
	}
	return out
}

func needDocker(t *testing.T) {
	t.Helper()
	if os.Getenv("MESHGPU_DOCKER_TEST") == "" {
		t.Skip("the image checks run under `make docker-test` (scripts/docker-test.sh builds the images, then sets MESHGPU_DOCKER_TEST=1)")
	}
	if _, err := exec.LookPath("docker"); err != nil {
		t.Fatal("MESHGPU_DOCKER_TEST is set but docker is not on PATH")
	}
	if out, err := exec.Command("docker", "info", "--format", "{{.ServerVersion}}").CombinedOutput(); err != nil {
		t.Fatalf("no Docker daemon answers: %v\n%s", err, out)
	}
}

// docker runs the docker CLI and returns its stdout, trimmed; a failure
// ends the test with stderr.
func docker(t testing.TB, args ...string) string {
	t.Helper()
	out, err := dockerErr(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func dockerErr(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "docker", args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("docker %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return strings.TrimSpace(stdout.String()), nil
}

// unique is a name for this run's containers and volumes.
func unique(what string) string {
	b := make([]byte, 4)
	rand.Read(b)
	return "meshgpu-test-" + what + "-" + hex.EncodeToString(b)
}

// volume makes a named volume, removed when the test ends.
func volume(t *testing.T) string {
	t.Helper()
	v := docker(t, "volume", "create", unique("data"))
	t.Cleanup(func() { dockerErr("volume", "rm", "-f", v) })
	return v
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// modelMount is the test model, bind-mounted read-only at /models/gocoder-6m.
func modelMount(t *testing.T) []string {
	t.Helper()
	dir, err := filepath.EvalSymlinks(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	if dir, err = filepath.Abs(dir); err != nil {
		t.Fatal(err)
	}
	return []string{"-v", dir + ":/models/gocoder-6m:ro"}
}

// container is one node in a container, on --network host.
type container struct {
	t     *testing.T
	name  string
	port  int
	image string
	model string // as /health names it, for the chat requests
}

// startNode runs `meshgpu run ARGS --listen 127.0.0.1:PORT` detached, with
// the image's HEALTHCHECK polled every second (its command is the image's;
// the URL names the port, the timing is the test's). The container is
// removed when the test ends, its logs shown first if the test failed.
func startNode(t *testing.T, img string, port int, dockerArgs []string, args ...string) *container {
	t.Helper()
	c := &container{t: t, name: unique("node"), port: port, image: img}
	run := []string{"run", "-d", "--name", c.name, "--network", "host",
		"--health-interval", "1s", "--health-timeout", "5s", "--health-retries", "3", "--health-start-period", "2m",
		"-e", fmt.Sprintf("MESHGPU_HEALTH_URL=http://127.0.0.1:%d/health", port)}
	run = append(run, dockerArgs...)
	run = append(run, img, "run")
	run = append(run, args...)
	run = append(run, "--listen", fmt.Sprintf("127.0.0.1:%d", port))
	docker(t, run...)
	t.Cleanup(func() {
		if t.Failed() {
			logs, _ := exec.Command("docker", "logs", c.name).CombinedOutput()
			t.Logf("docker logs %s:\n%s", c.name, logs)
		}
		dockerErr("rm", "-f", c.name)
	})
	return c
}

func (c *container) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", c.port, path)
}

// logs is the container's stdout and stderr.
func (c *container) logs() string {
	out, _ := exec.Command("docker", "logs", c.name).CombinedOutput()
	return string(out)
}

// health is what GET /health says.
type health struct {
	PeerID  string `json:"peer_id"`
	Model   string `json:"model"`
	Backend string `json:"backend"`
}

// waitHealth waits for GET /health to answer 200 while the container runs.
func (c *container) waitHealth() health {
	c.t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := hc.Get(c.url("/health"))
		if err == nil {
			var h health
			err = json.NewDecoder(resp.Body).Decode(&h)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && err == nil && h.PeerID != "" {
				c.model = h.Model
				return h
			}
		}
		if st, _ := dockerErr("inspect", "-f", "{{.State.Status}}", c.name); st != "running" {
			c.t.Fatalf("container %s is %q, not running", c.name, st)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: no healthy answer in 2 minutes (last error %v)", c.url("/health"), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitDockerHealthy waits for the image's HEALTHCHECK to report healthy.
func (c *container) waitDockerHealthy() {
	c.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		st := docker(c.t, "inspect", "-f", "{{.State.Health.Status}}", c.name)
		if st == "healthy" {
			return
		}
		if time.Now().After(deadline) {
			out, _ := dockerErr("inspect", "-f", "{{json .State.Health}}", c.name)
			c.t.Fatalf("HEALTHCHECK: %s after a minute: %s", st, out)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// chat posts a greedy chat completion and returns the answer's text.
func (c *container) chat() string {
	c.t.Helper()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"Write a loop."}],"max_tokens":16,"temperature":0}`, c.model)
	hc := &http.Client{Timeout: time.Minute}
	resp, err := hc.Post(c.url("/v1/chat/completions"), "application/json", strings.NewReader(body))
	if err != nil {
		c.t.Fatalf("chat completion: %v", err)
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK {
		c.t.Fatalf("chat completion: %s, %v", resp.Status, err)
	}
	if len(out.Choices) != 1 || out.Choices[0].Message.Content == "" || out.Usage.CompletionTokens == 0 {
		c.t.Fatalf("chat completion: no answer: %+v", out)
	}
	return out.Choices[0].Message.Content
}

// stop stops the container (SIGTERM) and checks the node exited cleanly.
func (c *container) stop() {
	c.t.Helper()
	docker(c.t, "stop", "-t", "30", c.name)
	if code := docker(c.t, "inspect", "-f", "{{.State.ExitCode}}", c.name); code != "0" {
		c.t.Fatalf("the node exited %s on SIGTERM", code)
	}
}

func TestVersion(t *testing.T) {
	needDocker(t)
	want := os.Getenv("MESHGPU_DOCKER_VERSION")
	for _, img := range images() {
		t.Run(img.tag, func(t *testing.T) {
			out := docker(t, "run", "--rm", "--network", "none", img.tag, "--version")
			if !strings.HasPrefix(out, "meshgpu ") || want != "" && !strings.Contains(out, " "+want+" ") {
				t.Fatalf("--version printed %q, want the revision %q", out, want)
			}
			t.Log(out)
		})
	}
}

// A node with the model mounted read-only and its key on a volume answers,
// is healthy, runs as the image's user, and keeps its peer id across a
// restart and across containers on that volume.
func TestNode(t *testing.T) {
	needDocker(t)
	for _, img := range images() {
		t.Run(img.tag, func(t *testing.T) {
			mount := append(modelMount(t), "-v", volume(t)+":/data")
			port := freePort(t)
			c := startNode(t, img.tag, port, mount, "--model", "/models/gocoder-6m")
			h := c.waitHealth()
			if h.Backend == "" || !strings.HasPrefix(h.Backend, "cpu") {
				t.Errorf("backend %q: want the cpu backend (no GPU here)", h.Backend)
			}
			answer := c.chat()
			t.Logf("peer %s, backend %s, answer %q", h.PeerID, h.Backend, answer)
			c.waitDockerHealthy()
			if uid := docker(t, "exec", c.name, "id", "-u"); uid == "0" {
				t.Errorf("the node runs as root")
			}
			key := fmt.Sprintf("/data/.meshgpu/node-%d.key", port)
			if _, err := dockerErr("exec", c.name, "test", "-s", key); err != nil {
				t.Errorf("no key at %s on the volume: %v", key, err)
			}
			if img.cuda {
				checkCUDAFallback(t, c)
			}

			docker(t, "restart", "-t", "30", c.name)
			h2 := c.waitHealth()
			if h2.PeerID != h.PeerID {
				t.Errorf("peer id %s after the restart, %s before", h2.PeerID, h.PeerID)
			}
			if again := c.chat(); again != answer {
				t.Errorf("greedy answer after the restart %q, before %q", again, answer)
			}
			c.stop()

			// A new container on the same volume is the same node.
			c2 := startNode(t, img.tag, port, mount, "--model", "/models/gocoder-6m")
			if h3 := c2.waitHealth(); h3.PeerID != h.PeerID {
				t.Errorf("peer id %s in a new container on the volume, %s before", h3.PeerID, h.PeerID)
			}
			c2.stop()
		})
	}
}

// checkCUDAFallback: the CUDA image without a GPU loads the library (its
// cuBLAS is found) and says in one line that it runs on the CPU.
func checkCUDAFallback(t *testing.T, c *container) {
	t.Helper()
	var lines []string
	for _, l := range strings.Split(c.logs(), "\n") {
		if strings.Contains(l, "cuda backend") {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 || !strings.Contains(lines[0], "using the cpu backend") || !strings.Contains(lines[0], "no CUDA device") {
		t.Errorf("want one line saying the node falls back to the cpu for want of a CUDA device (the library and cuBLAS load), got %q", lines)
	} else {
		t.Log(lines[0])
	}
	out := docker(t, "run", "--rm", "--network", "none", "--entrypoint", "ldd", c.image, "/usr/local/bin/libmeshgpu_cuda.so")
	if strings.Contains(out, "not found") {
		t.Errorf("libmeshgpu_cuda.so lacks libraries in the image:\n%s", out)
	}
}

// hub serves one repository of the hub's API shape (tree listing, resolve
// URLs with ranges) from a local model directory.
type hub struct {
	repo  string
	dir   string
	mu    sync.Mutex
	files map[string]int // resolve requests per file
}

func (h *hub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/api/models/"+h.repo+"/tree/main") {
		ents, _ := os.ReadDir(h.dir)
		var list []map[string]any
		for _, e := range ents {
			if e.IsDir() {
				continue
			}
			data, err := os.ReadFile(filepath.Join(h.dir, e.Name()))
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			blob := sha1.New()
			fmt.Fprintf(blob, "blob %d\x00", len(data))
			blob.Write(data)
			ent := map[string]any{"type": "file", "path": e.Name(), "size": len(data), "oid": hex.EncodeToString(blob.Sum(nil))}
			if strings.HasSuffix(e.Name(), ".safetensors") {
				sum := sha256.Sum256(data)
				ent["lfs"] = map[string]any{"oid": hex.EncodeToString(sum[:]), "size": len(data)}
			}
			list = append(list, ent)
		}
		json.NewEncoder(w).Encode(list)
		return
	}
	name, ok := strings.CutPrefix(r.URL.Path, "/"+h.repo+"/resolve/main/")
	if !ok || strings.Contains(name, "/") {
		http.NotFound(w, r)
		return
	}
	h.mu.Lock()
	h.files[name]++
	h.mu.Unlock()
	http.ServeFile(w, r, filepath.Join(h.dir, name))
}

func (h *hub) requests(name string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.files[name]
}

// `--model org/name` downloads into the volume's hub cache, and a restart
// loads it from there.
func TestHubModelIntoVolume(t *testing.T) {
	needDocker(t)
	img := images()[0]
	h := &hub{repo: "meshgpu-test/gocoder-6m", dir: testenv.GoCoder(t), files: map[string]int{}}
	srv := httptest.NewServer(h)
	defer srv.Close()
	vol := volume(t)
	c := startNode(t, img.tag, freePort(t), []string{"-v", vol + ":/data", "-e", "HF_ENDPOINT=" + srv.URL}, "--model", h.repo)
	first := c.waitHealth()
	c.chat()
	if h.requests("model.safetensors") == 0 {
		t.Fatal("the node did not fetch model.safetensors from the hub")
	}
	if _, err := dockerErr("exec", c.name, "test", "-s", "/data/hub/meshgpu-test--gocoder-6m/main/model.safetensors"); err != nil {
		t.Fatalf("the download is not in the volume's hub cache: %v", err)
	}
	n := h.requests("model.safetensors")
	docker(t, "restart", "-t", "30", c.name)
	if again := c.waitHealth(); again.PeerID != first.PeerID {
		t.Errorf("peer id %s after the restart, %s before", again.PeerID, first.PeerID)
	}
	c.chat()
	if m := h.requests("model.safetensors"); m != n {
		t.Errorf("model.safetensors fetched again after the restart (%d requests, %d before)", m, n)
	}
	c.stop()
}

// `meshgpu demo --once` (relay, tracker, three nodes) in a container with
// no network at all.
func TestDemoOnce(t *testing.T) {
	needDocker(t)
	for _, img := range images() {
		t.Run(img.tag, func(t *testing.T) {
			args := append([]string{"run", "--rm", "--network", "none"}, modelMount(t)...)
			out := docker(t, append(args, img.tag, "demo", "--once", "--model", "/models/gocoder-6m")...)
			if out == "" {
				t.Fatal("demo --once printed nothing")
			}
			t.Logf("demo --once:\n%s", out)
		})
	}
}
