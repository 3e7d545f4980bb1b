package apiauth

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

func serve(t *testing.T, cfg Config) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "generated") })
	mux.HandleFunc("POST /forward", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hop") })
	ts := httptest.NewServer(Middleware(cfg, mux))
	t.Cleanup(ts.Close)
	return ts
}

func do(t *testing.T, method, url string, h map[string]string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	for k, v := range h {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func TestAPIKeys(t *testing.T) {
	ts := serve(t, Config{Keys: []string{"k-one", "k-two"}})
	url := ts.URL + "/v1/chat/completions"
	for name, auth := range map[string]string{"none": "", "wrong": "Bearer k-three", "prefix": "Bearer k-on", "basic": "Basic k-one", "bare": "k-one"} {
		resp, body := do(t, "POST", url, map[string]string{"Authorization": auth})
		if resp.StatusCode != 401 {
			t.Errorf("%s: status %d, want 401", name, resp.StatusCode)
			continue
		}
		var e struct {
			Error struct{ Message, Type, Code string }
		}
		if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Code != "invalid_api_key" || e.Error.Type != "invalid_request_error" || e.Error.Message == "" {
			t.Errorf("%s: body %q is not an OpenAI invalid_api_key error", name, body)
		}
	}
	for _, k := range []string{"k-one", "k-two"} {
		if resp, body := do(t, "POST", url, map[string]string{"Authorization": "Bearer " + k}); resp.StatusCode != 200 || body != "generated" {
			t.Errorf("key %s: %d %q", k, resp.StatusCode, body)
		}
	}
	// Hop endpoints are not covered by API keys.
	if resp, _ := do(t, "POST", ts.URL+"/forward", nil); resp.StatusCode != 200 {
		t.Errorf("/forward without a key: %d, want it untouched", resp.StatusCode)
	}
}

func TestCORSPreflight(t *testing.T) {
	ts := serve(t, Config{Keys: []string{"k"}, AllowedOrigins: []string{"http://localhost:3000"}})
	url := ts.URL + "/v1/chat/completions"
	pre := map[string]string{"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
		"Access-Control-Request-Headers": "authorization,content-type"}
	resp, _ := do(t, "OPTIONS", url, pre)
	if resp.StatusCode != 204 || resp.Header.Get("Access-Control-Allow-Origin") != "http://localhost:3000" ||
		resp.Header.Get("Access-Control-Allow-Methods") == "" || resp.Header.Get("Access-Control-Allow-Headers") == "" {
		t.Fatalf("preflight from the allowed origin: %d %v", resp.StatusCode, resp.Header)
	}
	pre["Origin"] = "http://evil.example"
	resp, _ = do(t, "OPTIONS", url, pre)
	if resp.StatusCode != 403 || resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("preflight from another origin: %d %v", resp.StatusCode, resp.Header)
	}
	// The actual request from the allowed origin carries the header too.
	resp, _ = do(t, "POST", url, map[string]string{"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
	if resp.StatusCode != 200 || resp.Header.Get("Access-Control-Allow-Origin") != "http://localhost:3000" {
		t.Fatalf("request from the allowed origin: %d %v", resp.StatusCode, resp.Header)
	}
	resp, _ = do(t, "POST", url, map[string]string{"Origin": "http://evil.example", "Authorization": "Bearer k"})
	if resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("another origin got CORS headers: %v", resp.Header)
	}
}

func TestLoadKeys(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "keys")
	os.WriteFile(f, []byte("# team keys\nalpha\n\n  beta  \n"), 0o600)
	got, err := LoadKeys([]string{"flag"}, f)
	if err != nil || len(got) != 3 || got[0] != "flag" || got[1] != "alpha" || got[2] != "beta" {
		t.Fatalf("LoadKeys = %q, %v", got, err)
	}
	os.WriteFile(f, []byte("# nothing\n"), 0o600)
	if _, err := LoadKeys(nil, f); err == nil {
		t.Fatal("a key file without keys accepted")
	}
	if _, err := LoadKeys([]string{"has space"}, ""); err == nil {
		t.Fatal("a key with a space accepted")
	}
	if _, err := LoadKeys(nil, filepath.Join(dir, "missing")); err == nil {
		t.Fatal("a missing key file accepted")
	}
	if err := CheckOrigins([]string{"http://localhost:3000", "https://a.example", "*"}); err != nil {
		t.Fatal(err)
	}
	for _, o := range []string{"localhost:3000", "http://a.example/path", "ftp://a"} {
		if CheckOrigins([]string{o}) == nil {
			t.Errorf("origin %q accepted", o)
		}
	}
}
