package tracker

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"meshgpu/internal/apiauth"
)

// The tracker's OpenAI endpoints need the key; its node-facing and
// control endpoints do not (they are signed).
func TestTrackerAPIKey(t *testing.T) {
	_, ts := startTracker(t, Config{APIAuth: apiauth.Config{Keys: []string{"sk-t"}, AllowedOrigins: []string{"http://localhost:3000"}}})
	hc := httpClient(t)
	do := func(method, path, key string, h map[string]string) (*http.Response, string) {
		req, _ := http.NewRequest(method, ts.URL+path, strings.NewReader(""))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	if resp, b := do("GET", "/v1/models", "", nil); resp.StatusCode != 401 || !strings.Contains(b, "invalid_api_key") {
		t.Fatalf("no key: %d %s", resp.StatusCode, b)
	}
	if resp, b := do("POST", "/v1/chat/completions", "nope", nil); resp.StatusCode != 401 {
		t.Fatalf("wrong key: %d %s", resp.StatusCode, b)
	}
	if resp, b := do("GET", "/v1/models", "sk-t", nil); resp.StatusCode != 200 || !strings.Contains(b, `"list"`) {
		t.Fatalf("right key: %d %s", resp.StatusCode, b)
	}
	if resp, b := do("GET", "/health", "", nil); resp.StatusCode != 200 {
		t.Fatalf("/health asks for a key: %d %s", resp.StatusCode, b)
	}
	if resp, b := do("POST", "/register", "", nil); resp.StatusCode == 401 && strings.Contains(b, "invalid_api_key") {
		t.Fatalf("/register asks for an API key: %s", b)
	}
	resp, _ := do("OPTIONS", "/v1/chat/completions", "", map[string]string{"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
	if resp.StatusCode != 204 || resp.Header.Get("Access-Control-Allow-Origin") != "http://localhost:3000" {
		t.Fatalf("preflight: %d %v", resp.StatusCode, resp.Header)
	}
}
