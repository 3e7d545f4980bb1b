package relay

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// errTunnelUnsupported means the relay has no /tunnel or speaks another
// version; callers fall back to /ws or /rpc.
var errTunnelUnsupported = errors.New("relay does not support tunnel protocol version 1")

// errRelayLost fails requests in flight when the relay connection drops.
var errRelayLost = errors.New("relay connection lost")

// RelayError is a failure reported by the relay itself (peer not connected,
// limited, timed out, registration refused), not an answer from the node.
type RelayError struct {
	Code    int    // HTTP-like status
	Type    string // e.g. peer_not_connected, rate_limited
	Message string
}

func (e *RelayError) Error() string {
	if e.Type != "" {
		return fmt.Sprintf("relay: %s (%d %s)", e.Message, e.Code, e.Type)
	}
	return fmt.Sprintf("relay: %s (%d)", e.Message, e.Code)
}

// relayErrorType names tunnel Error codes, which carry no type string.
func relayErrorType(code int) string {
	switch code {
	case http.StatusNotFound:
		return "peer_not_connected"
	case http.StatusTooManyRequests:
		return "rate_limited"
	case http.StatusGatewayTimeout:
		return "timeout"
	case http.StatusServiceUnavailable:
		return "peer_busy"
	case http.StatusBadGateway:
		return "peer_error"
	case http.StatusUnauthorized, http.StatusForbidden:
		return "unauthorized"
	}
	return "relay_error"
}

// relayBase turns a relay URL (ws, wss, http or https; with or without a
// /rpc/{peer} suffix) into the ws(s)://host[/prefix] base.
func relayBase(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("relay URL %q: %w", raw, err)
	}
	switch u.Scheme {
	case "ws", "wss":
	case "http":
		u.Scheme = "ws"
	case "https":
		u.Scheme = "wss"
	default:
		return "", fmt.Errorf("relay URL %q must start with ws://, wss://, http:// or https://", raw)
	}
	if u.Host == "" {
		return "", fmt.Errorf("relay URL %q has no host", raw)
	}
	if i := strings.Index(u.Path, "/rpc/"); i >= 0 {
		u.Path = u.Path[:i]
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawQuery, u.Fragment, u.RawPath = "", "", ""
	return u.String(), nil
}

// splitRelayAddr splits a hop's relay_addr ws://relay/rpc/{peer_id}.
func splitRelayAddr(addr string) (base, peer string, err error) {
	u, err := url.Parse(addr)
	if err != nil {
		return "", "", fmt.Errorf("relay_addr %q: %w", addr, err)
	}
	i := strings.LastIndex(u.Path, "/rpc/")
	if i < 0 {
		return "", "", fmt.Errorf("relay_addr %q must end in /rpc/{peer_id}", addr)
	}
	peer = u.Path[i+len("/rpc/"):]
	if !validPeerID(peer) {
		return "", "", fmt.Errorf("relay_addr %q: bad peer id", addr)
	}
	base, err = relayBase(addr)
	return base, peer, err
}
