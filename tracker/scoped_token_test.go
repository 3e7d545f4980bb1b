package tracker

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// The node's tracker join token goes to the trackers its operator named,
// never to one that a heartbeat answer listed (an answer is a message).
func TestJoinTokenNotSentToLearnedTracker(t *testing.T) {
	const secret = "tr4cker-s3cret"
	var mu sync.Mutex
	bodies := map[string][]string{}
	record := func(name string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			mu.Lock()
			bodies[name] = append(bodies[name], string(b))
			mu.Unlock()
			w.Write([]byte(`{}`))
		}
	}
	attacker := httptest.NewServer(record("attacker"))
	defer attacker.Close()
	own := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/heartbeat" {
			w.Write([]byte(`{"trackers":[{"peer_id":"mg-evil","public_key":"00","url":"` + attacker.URL + `"}]}`))
			return
		}
		record("own")(httptest.NewRecorder(), r)
		http.Error(w, `{"error":{"message":"down","type":"server_error"}}`, 503) // so the client moves on
	}))
	defer own.Close()
	c := &Client{URL: own.URL, Identity: newIdentity(t), HTTP: &http.Client{Timeout: 5 * time.Second}}
	ctx := context.Background()
	if _, err := c.Heartbeat(ctx, Heartbeat{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Register(ctx, Registration{Model: "m", NumLayers: 6, JoinToken: secret}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Assign(ctx, AssignRequest{Model: "m", NumLayers: 6, JoinToken: secret}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bodies["own"]) == 0 || !strings.Contains(bodies["own"][0], secret) {
		t.Fatalf("the configured tracker did not get the token: %q", bodies["own"])
	}
	if len(bodies["attacker"]) < 2 {
		t.Fatalf("the learned tracker was not tried: %q", bodies["attacker"])
	}
	for _, b := range bodies["attacker"] {
		if strings.Contains(b, secret) {
			t.Fatalf("the learned tracker received the join token: %s", b)
		}
	}
}
