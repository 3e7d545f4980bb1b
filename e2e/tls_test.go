package e2e

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
)

// testCA writes a private CA and a certificate it signs for 127.0.0.1
// into dir: ca.pem, cert.pem, key.pem (what an operator gets from a CA).
func testCA(t *testing.T, dir string) (ca, cert, key string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "meshgpu test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leafTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames: []string{"localhost"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, caCert, &leafKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(leafKey)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return write("ca.pem", "CERTIFICATE", caDER), write("cert.pem", "CERTIFICATE", leafDER), write("key.pem", "PRIVATE KEY", keyDER)
}

// openaiSDK returns the path of sdk-chat.mjs when node and the openai
// package beside it are installed, and skips the test otherwise.
func openaiSDK(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(testenv.RepoRoot(), "e2e", "testdata", "openai-sdk")
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("skipping: no node to run the openai SDK (apt-get install nodejs)")
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "openai", "package.json")); err != nil {
		t.Skip("skipping: the openai Node SDK is not installed: npm install --no-save --no-package-lock --prefix e2e/testdata/openai-sdk openai@6 (.ci/run does)")
	}
	return filepath.Join(dir, "sdk-chat.mjs")
}

// sdkResult is what sdk-chat.mjs prints.
type sdkResult struct {
	Text      string `json:"text"`
	Stream    string `json:"stream"`
	ToolCalls []struct {
		ID       string `json:"id"`
		Type     string `json:"type"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
	FinishReason string `json:"finish_reason"`
}

// runSDK runs sdk-chat.mjs against base with env added.
func runSDK(t *testing.T, script, base, mode string, env ...string) sdkResult {
	t.Helper()
	cmd := exec.Command("node", script, base, mode)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("openai SDK against %s: %v\n%s%s", base, err, out, stderr)
	}
	var r sdkResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("openai SDK printed %q: %v", out, err)
	}
	return r
}

// Issue 30: `meshgpu tracker --tls-cert C --tls-key K` and a head started
// likewise answer the official OpenAI SDK over https (a private CA the
// clients are told about, as an operator's own would be). Nodes register
// with the tracker over https (SSL_CERT_FILE); hops between nodes that
// serve an operator's certificate keep their TLS pinned to peer ids (the
// tail serves both on one port), and plain http still answers on the
// nodes' port for the tracker's proxy.
func TestAPIOverTLSWithTheOpenAISDK(t *testing.T) {
	dir := testenv.GoCoder(t)
	sdk := openaiSDK(t)
	ca, cert, keyFile := testCA(t, t.TempDir())
	goEnv := []string{"SSL_CERT_FILE=" + ca}
	nodeEnv := []string{"NODE_EXTRA_CA_CERTS=" + ca}
	tp, trackerAddr := startProcEnv(t, "tracker", addrLine, goEnv, "tracker", "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", keyFile)
	trackerURL := "https://" + trackerAddr
	if !strings.Contains(tp.log(), "url="+trackerURL) {
		t.Fatalf("the tracker does not say it serves %s:\n%s", trackerURL, tp.log())
	}
	// The static head's key is made first: the tail trusts its peer id.
	staticKey := filepath.Join(t.TempDir(), "static.key")
	staticID, err := identity.LoadOrCreate(staticKey)
	if err != nil {
		t.Fatal(err)
	}
	node := func(name, key, layers string, extra ...string) string {
		args := append([]string{"run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key,
			"--layers", layers, "--listen", "127.0.0.1:0", "--hop-dtype", "f32", "--tls-cert", cert, "--tls-key", keyFile}, extra...)
		p, _ := startProcEnv(t, name, nodeLine, goEnv, args...)
		return regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(p.log())[1]
	}
	tail := node("tail", filepath.Join(t.TempDir(), "tail.key"), "3-5", "--tracker", trackerURL, "--heartbeat-interval", "500ms", "--trust-head", staticID.PeerID)
	node("head", filepath.Join(t.TempDir(), "head.key"), "0-2", "--tracker", trackerURL, "--heartbeat-interval", "500ms")
	static := node("static head", staticKey, "0-2", "--peer", "http://"+tail)

	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool(t, ca)}}}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		var m struct{ Covered bool }
		if resp, err := hc.Get(trackerURL + "/map?model=gocoder-6m"); err == nil {
			json.NewDecoder(resp.Body).Decode(&m)
			resp.Body.Close()
		}
		if m.Covered {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the https tracker's map is not covered:\n%s", tail1(tp.log()))
		}
	}
	viaTracker := runSDK(t, sdk, trackerURL, "plain", nodeEnv...)
	direct := runSDK(t, sdk, "https://"+static, "plain", nodeEnv...)
	t.Logf("SDK over https: tracker %q, static head %q", viaTracker.Text, direct.Text)
	if viaTracker.Text == "" || viaTracker.Text != viaTracker.Stream || direct.Text != viaTracker.Text || direct.Stream != viaTracker.Text {
		t.Fatalf("SDK answers over https: tracker %+v, static head %+v; want one text, streamed and not", viaTracker, direct)
	}
	// The node's port: the operator's certificate for API clients, plain
	// HTTP for the tracker's proxy and old peers.
	resp, err := hc.Get("https://" + tail + "/health")
	if err != nil {
		t.Fatalf("https client against a node with --tls-cert: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.TLS == nil || resp.TLS.PeerCertificates[0].Subject.CommonName != "127.0.0.1" {
		t.Fatalf("GET https://%s/health: %d %+v", tail, resp.StatusCode, resp.TLS)
	}
	if st, _ := getStatus(newHTTPClient(t), "http://"+tail+"/health"); st != 200 {
		t.Fatalf("plain GET /health on the node's port: %d", st)
	}
}

func pool(t *testing.T, caFile string) *x509.CertPool {
	b, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		t.Fatal("bad CA file")
	}
	return p
}

func tail1(s string) string { return tail(s, 3000) }
