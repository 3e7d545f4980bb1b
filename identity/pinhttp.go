package identity

import (
	"context"
	"net/http"
	"sync"

	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

type peerKey struct{}

// WithPeerID names the peer id an https request made with ctx must reach
// (PinnedTransport): its TLS certificate must carry that peer id's key.
func WithPeerID(ctx context.Context, peerID string) context.Context {
	return context.WithValue(ctx, peerKey{}, peerID)
}

func peerOf(ctx context.Context) string {
	p, _ := ctx.Value(peerKey{}).(string)
	return p
}

// maxPinnedPeers bounds PinnedTransport's pools; past it idle ones go.
const maxPinnedPeers = 4096

// PinnedTransport sends an https request whose context names a peer id
// (WithPeerID) over TLS accepting exactly that peer id's key
// (ClientTLSConfig), offering wire.HopTLSProto so a node that also serves
// an operator's certificate answers with its identity one. Each peer id
// has its own connection pool (a clone of Base): a connection pinned to
// one key is never reused for another peer at the same address. Other
// requests go to Base unchanged.
type PinnedTransport struct {
	Base *http.Transport

	mu     sync.Mutex
	byPeer boundmap.Map[string, *http.Transport]
}

func (t *PinnedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	peer := peerOf(req.Context())
	if req.URL.Scheme != "https" || peer == "" {
		return t.Base.RoundTrip(req)
	}
	return t.peer(peer).RoundTrip(req)
}

func (t *PinnedTransport) peer(peerID string) *http.Transport {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tr, _ := t.byPeer.Get(peerID); tr != nil {
		return tr
	}
	if t.byPeer.Max == 0 {
		t.byPeer.Max = maxPinnedPeers
		// requests in flight on an evicted pool finish on it
		t.byPeer.Evicted = func(_ string, tr *http.Transport) { tr.CloseIdleConnections() }
	}
	tr := t.Base.Clone()
	cfg := ClientTLSConfig(peerID, nil)
	cfg.NextProtos = []string{wire.HopTLSProto, "http/1.1"}
	tr.TLSClientConfig = cfg
	tr.ForceAttemptHTTP2 = false
	t.byPeer.Put(peerID, tr)
	return tr
}

// CloseIdleConnections closes the idle connections of every pool.
func (t *PinnedTransport) CloseIdleConnections() {
	t.Base.CloseIdleConnections()
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, tr := range t.byPeer.All() {
		tr.CloseIdleConnections()
	}
}
