package tracker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/time/rate"

	"meshgpu/identity"
	"meshgpu/internal/source"
)

// AddrPolicy says which addresses a registrant may name as its endpoint or
// relay, and so which the tracker will connect to on its behalf. Link-local
// (169.254.0.0/16 with the cloud metadata service, fe80::/10), unspecified
// (0.0.0.0, ::), multicast and broadcast addresses are always refused.
// The zero value also refuses loopback and private ranges: an open mesh's
// tracker must not be made to call its own host's or LAN's services.
type AddrPolicy struct {
	// AllowLoopback admits 127.0.0.0/8 and ::1 (one-machine meshes, tests,
	// the demo; `meshgpu tracker` allows it when it listens on loopback).
	AllowLoopback bool
	// AllowPrivate admits 10/8, 172.16/12, 192.168/16, 100.64/10 (CGNAT)
	// and fc00::/7 (LAN meshes).
	AllowPrivate bool
}

var cgnat = netip.MustParsePrefix("100.64.0.0/10")

// checkIP refuses an address the policy does not admit.
func (p AddrPolicy) checkIP(ip netip.Addr) error {
	ip = ip.Unmap()
	switch {
	case !ip.IsValid(), ip.IsUnspecified():
		return fmt.Errorf("%v is the unspecified address", ip)
	case ip.IsLinkLocalUnicast():
		return fmt.Errorf("%v is link-local (where cloud metadata services live)", ip)
	case ip.IsLinkLocalMulticast(), ip.IsInterfaceLocalMulticast():
		return fmt.Errorf("%v is a link-local multicast address (a group on the tracker's own network segment, no node)", ip)
	case ip.IsMulticast():
		return fmt.Errorf("%v is a multicast address (a group, no node)", ip)
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return fmt.Errorf("%v is the broadcast address", ip)
	case ip.IsLoopback() && !p.AllowLoopback:
		return fmt.Errorf("%v is loopback (allowed only with --allow-loopback-endpoints)", ip)
	case (ip.IsPrivate() || cgnat.Contains(ip)) && !p.AllowPrivate:
		return fmt.Errorf("%v is a private address (allowed only with --allow-private-endpoints)", ip)
	}
	return nil
}

// checkURL resolves raw's host and refuses it when any address it names is
// not admitted. Dialing checks again (dialControl), so a name that resolves
// elsewhere later (DNS rebinding) is still refused.
func (p AddrPolicy) checkURL(ctx context.Context, field, raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("%s: %w", field, err)
	}
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		if err := p.checkIP(ip); err != nil {
			return fmt.Errorf("%s %s: %w", field, raw, err)
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return fmt.Errorf("%s %s: %w", field, raw, err)
	}
	for _, ip := range addrs {
		if err := p.checkIP(ip); err != nil {
			return fmt.Errorf("%s %s resolves to %w", field, raw, err)
		}
	}
	return nil
}

// dialControl refuses, at connect time, an address the policy does not
// admit (for net.Dialer.Control).
func (p AddrPolicy) dialControl(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return err
	}
	return p.checkIP(ap.Addr())
}

// HTTPClient returns a client whose connections only reach admitted
// addresses and never follow redirects (a node could point them anywhere).
func (p AddrPolicy) HTTPClient(timeout time.Duration) *http.Client {
	return p.httpClient(timeout, true)
}

// httpClient is HTTPClient, keeping connections alive or not (a challenge
// is one request per registration: no idle connection to every node).
func (p AddrPolicy) httpClient(timeout time.Duration, keepAlive bool) *http.Client {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, Control: p.dialControl}).DialContext,
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     90 * time.Second,
		DisableKeepAlives:   !keepAlive,
	}
	// An https endpoint is a node's pinned hop TLS: reached only as the
	// peer id the request names (identity.WithPeerID).
	return &http.Client{Transport: &identity.PinnedTransport{Base: tr}, Timeout: timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// Defaults of the registration limits.
const (
	DefaultRegisterPerIP    = 5.0 // registrations and assignments per second per source address
	DefaultRegisterIPBurst  = 50
	DefaultRegisterPerKey   = 1.0 // registrations per second per peer id
	DefaultRegisterKeyBurst = 10
	DefaultChallengeTimeout = 5 * time.Second
	// maxLimiters bounds the limiter table; idle entries are dropped first.
	maxLimiters = 16384
)

// limiter is a table of token buckets by key. It is per process: each
// tracker of a mesh limits what reaches it (a shared limit would cost a
// store round trip per registration).
type limiter struct {
	mu    sync.Mutex
	rate  rate.Limit
	burst int
	m     map[string]*rate.Limiter
}

func newLimiter(perSecond float64, burst int) *limiter {
	return &limiter{rate: rate.Limit(perSecond), burst: burst, m: map[string]*rate.Limiter{}}
}

func (l *limiter) allow(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.m[key]
	if !ok {
		if len(l.m) >= maxLimiters {
			for k, v := range l.m { // full buckets are idle: forgetting them changes nothing
				if v.TokensAt(now) >= float64(l.burst) {
					delete(l.m, k)
				}
			}
			if len(l.m) >= maxLimiters {
				return false
			}
		}
		b = rate.NewLimiter(l.rate, l.burst)
		l.m[key] = b
	}
	return b.AllowN(now, 1)
}

// sourceKey is the rate-limit key of a remote address (source.Key).
func sourceKey(remoteAddr string) string { return source.Key(remoteAddr) }

// Verification outcomes recorded in NodeRecord.Verified.
const (
	// VerifiedEndpoint: the endpoint answered the identity challenge as
	// the registered peer id, with the registered model and layers.
	VerifiedEndpoint = "endpoint"
	// VerifiedRelay: the node answered the challenge through its relay.
	VerifiedRelay = "relay"
	// VerifiedByRelay: the tracker has no relay client; the relay_addr
	// names the registrant's own peer id, and the relay admits a peer id
	// only with a signature by its key, so hops through it reach that key's
	// holder or nobody. Model and layers are unchecked.
	VerifiedByRelay = "by-relay"
)

// challenger proves registrations: it asks the registered endpoint (or the
// node through its relay) to sign a fresh nonce.
type challenger struct {
	self    string // this tracker's peer id, bound into the proof
	policy  AddrPolicy
	http    *http.Client
	relay   RelayDoer
	timeout time.Duration
}

// prove challenges reg's addresses and returns how it was verified.
func (c *challenger) prove(ctx context.Context, reg *Registration) (string, error) {
	if reg.RelayAddr != "" {
		if peer, err := relayPeer(reg.RelayAddr); err != nil || peer != reg.PeerID {
			return "", errf(400, "invalid_request_error", "relay_addr must end in /rpc/%s, the registrant's own peer id", reg.PeerID)
		}
	}
	how := ""
	if reg.Endpoint != "" {
		if err := c.ask(ctx, reg, reg.Endpoint, func(req *http.Request) (*http.Response, error) { return c.http.Do(req) }); err != nil {
			return "", err
		}
		how = VerifiedEndpoint
	}
	if reg.RelayAddr != "" {
		if c.relay == nil {
			if how == "" {
				how = VerifiedByRelay
			}
			return how, nil
		}
		err := c.ask(ctx, reg, reg.RelayAddr, func(req *http.Request) (*http.Response, error) {
			return c.relay.Do(req.Context(), reg.RelayAddr, req)
		})
		if err != nil {
			return "", err
		}
		if how == "" {
			how = VerifiedRelay
		}
	}
	return how, nil
}

func relayPeer(addr string) (string, error) {
	u, err := url.Parse(addr)
	if err != nil {
		return "", err
	}
	i := strings.LastIndex(u.Path, "/rpc/")
	if i < 0 {
		return "", errors.New("no /rpc/ in relay_addr")
	}
	return u.Path[i+len("/rpc/"):], nil
}

// ask sends the challenge to addr and checks the proof.
func (c *challenger) ask(ctx context.Context, reg *Registration, addr string, do func(*http.Request) (*http.Response, error)) error {
	var nb [16]byte
	if _, err := rand.Read(nb[:]); err != nil {
		return err
	}
	nonce := hex.EncodeToString(nb[:])
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	q := url.Values{"nonce": {nonce}, "endpoint": {addr}, "tracker": {c.self}}
	base := strings.TrimSuffix(addr, "/")
	if addr == reg.RelayAddr {
		base = "http://relay.invalid" // the relay client carries the path only
	}
	req, err := http.NewRequestWithContext(identity.WithPeerID(ctx, reg.PeerID), http.MethodGet, base+identity.ProofPath+"?"+q.Encode(), nil)
	if err != nil {
		return errf(400, "invalid_request_error", "%s: %v", addr, err)
	}
	resp, err := do(req)
	if err != nil {
		return errf(422, "unverified_endpoint", "%s did not answer the identity challenge: %v", addr, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	if err != nil || resp.StatusCode != http.StatusOK {
		return errf(422, "unverified_endpoint", "%s answered the identity challenge with HTTP %d", addr, resp.StatusCode)
	}
	var p identity.Proof
	if err := json.Unmarshal(body, &p); err != nil {
		return errf(422, "unverified_endpoint", "%s answered the identity challenge with something else than a proof", addr)
	}
	if err := identity.VerifyProof(p, reg.PeerID, nonce, addr, c.self); err != nil {
		return errf(403, "unverified_endpoint", "%s does not answer as %s: %v", addr, reg.PeerID, err)
	}
	if p.Model != reg.Model || p.Layers != reg.Layers {
		return errf(403, "unverified_endpoint", "%s serves %s layers %d-%d, not the registered %s layers %d-%d",
			addr, p.Model, p.Layers[0], p.Layers[1], reg.Model, reg.Layers[0], reg.Layers[1])
	}
	return nil
}
