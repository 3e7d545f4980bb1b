package relay

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// A relay address that arrives in a message (a route hop's relay_addr, a
// registrant's) is dialed without the join token: the token goes only to
// the relay the operator configured. The attacker's relay here is a real
// relay that accepts the victim's token: had the client presented it, the
// attacker would have been let in (and the hop answered "peer not
// connected" instead of 401).
func TestJoinTokenOnlyToConfiguredRelay(t *testing.T) {
	testenv.CheckGoroutines(t)
	const secret = "s3cret"
	tb := newTestbed(t, nil, &Server{JoinToken: secret}, nil)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	attacker := &Server{JoinToken: secret, Logger: quiet}
	ats := httptest.NewServer(attacker.Handler())
	defer ats.Close()
	defer attacker.Close()
	attackerAddr := "ws://" + strings.TrimPrefix(ats.URL, "http://") + "/rpc/" + tb.bridge.Identity.PeerID

	// A fake relay that records every header it is sent.
	var mu sync.Mutex
	var seen []string
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		for k, v := range r.Header {
			seen = append(seen, k+": "+strings.Join(v, ","))
		}
		mu.Unlock()
		http.Error(w, "no", 400)
	}))
	defer fake.Close()
	fakeAddr := "ws://" + strings.TrimPrefix(fake.URL, "http://") + "/rpc/" + tb.bridge.Identity.PeerID

	for _, mode := range []struct {
		name string
		rpc  bool
	}{{"tunnel", false}, {"rpc", true}} {
		c := &Client{JoinToken: secret, JoinTokenRelay: tb.relayBase, DisableTunnel: mode.rpc}
		if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(4), 1); st != 200 {
			t.Fatalf("%s: hop through the configured relay: %d", mode.name, st)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.Do(ctx, attackerAddr, hopReq(t, bf16Payload(4), 1))
		cancel()
		var re *RelayError
		if !errors.As(err, &re) || (re.Code != 401 && re.Code != 403) {
			t.Errorf("%s: hop through a relay named in a message: %v, want the attacker's 401 (no token presented)", mode.name, err)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
		c.Do(ctx, fakeAddr, hopReq(t, bf16Payload(4), 1))
		cancel()
		c.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) == 0 {
		t.Fatal("the fake relay was never dialed: the test checks nothing")
	}
	for _, h := range seen {
		if strings.Contains(h, secret) {
			t.Fatalf("the fake relay received the join token: %s", h)
		}
	}
}
