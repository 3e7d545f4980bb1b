package node

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/apiauth"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// A head with --api-key answers its OpenAI endpoints only with the key; its
// hop endpoint is not covered (hops are authenticated otherwise).
func TestHeadAPIKey(t *testing.T) {
	testenv.CheckGoroutines(t)
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	m, err := engine.Load(dir, engine.Options{Backend: be, Last: -1, MaxContext: 256})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	url := startNode(t, &Server{Model: m, Backend: be, PeerID: "head",
		APIAuth: apiauth.Config{Keys: []string{"sk-test"}, AllowedOrigins: []string{"http://localhost:3000"}}})
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	post := func(path, key, body string) (int, string) {
		req, _ := http.NewRequest("POST", url+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	body := `{"prompt":"def add(a, b):","max_tokens":3}`
	if code, b := post("/v1/completions", "", body); code != 401 || !strings.Contains(b, `"invalid_api_key"`) {
		t.Fatalf("no key: %d %s", code, b)
	}
	if code, b := post("/v1/completions", "sk-wrong", body); code != 401 {
		t.Fatalf("wrong key: %d %s", code, b)
	}
	if code, b := post("/v1/completions", "sk-test", body); code != 200 || !strings.Contains(b, `"text"`) {
		t.Fatalf("right key: %d %s", code, b)
	}
	if code, b := post("/forward", "", "x"); code == 401 {
		t.Fatalf("the hop endpoint asks for an API key: %s", b)
	}
	req, _ := http.NewRequest("OPTIONS", url+"/v1/chat/completions", nil)
	req.Header.Set("Origin", "http://localhost:3000")
	req.Header.Set("Access-Control-Request-Method", "POST")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 || resp.Header.Get("Access-Control-Allow-Origin") != "http://localhost:3000" {
		t.Fatalf("preflight: %d %v", resp.StatusCode, resp.Header)
	}
}
