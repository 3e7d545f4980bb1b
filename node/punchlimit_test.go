package node

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/relay"
	"meshgpu/wire"
)

// offer posts body to the tail's punch path through the relay as a fresh
// peer would (the relay names it as the source): the response's status,
// Retry-After and body.
func (p *relayedPair) offer(t *testing.T, rc *relay.Client, body []byte) (int, string, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(identity.WithPeerID(ctx, p.tail.PeerID), http.MethodPost, "http://"+p.tail.PeerID+wire.PunchPath, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := rc.Do(ctx, p.addr, req)
	if err != nil {
		t.Fatalf("offer through the relay: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Retry-After"), b
}

func (p *relayedPair) peer(t *testing.T) *relay.Client {
	rc := &relay.Client{Identity: newID(t), Logger: quietLogger()}
	t.Cleanup(func() { rc.Close() })
	return rc
}

// punchSink is a UDP socket standing in for an offer's candidate: it
// counts the punches it gets by nonce, and any packet that is no punch.
type punchSink struct {
	pc   net.PacketConn
	mu   sync.Mutex
	by   map[string]int // nonce (hex) -> punches
	bad  int            // packets other than a 20-byte punch
	done chan struct{}
}

func newPunchSink(t *testing.T) *punchSink {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &punchSink{pc: pc, by: map[string]int{}, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		buf := make([]byte, 2048)
		for {
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			kind, id, _, perr := wire.ParsePathPacket(buf[:n])
			s.mu.Lock()
			if perr != nil || kind != wire.PathPunch || n != len(wire.AppendPathPunch(nil, id)) {
				s.bad++
			} else {
				s.by[hex.EncodeToString(id[:])]++
			}
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { pc.Close(); <-s.done })
	return s
}

func (s *punchSink) counts() (map[string]int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]int{}
	for k, v := range s.by {
		out[k] = v
	}
	return out, s.bad
}

func offerBody(nonce byte, candidates ...string) []byte {
	b, _ := json.Marshal(wire.PunchOffer{Nonce: strings.Repeat(fmt.Sprintf("%02x", nonce), 16), Candidates: candidates})
	return b
}

func wantAPIError(t *testing.T, what string, status int, body []byte, wantStatus int, wantType string) {
	t.Helper()
	var e struct {
		Error struct{ Type, Message string } `json:"error"`
	}
	if status != wantStatus || json.Unmarshal(body, &e) != nil || e.Error.Type != wantType {
		t.Fatalf("%s: %d %s, want %d with a JSON error of type %s", what, status, body, wantStatus, wantType)
	}
}

// Peers on the relay offering paths all at once cannot turn a node into a
// flood of punches: of 12 concurrent offers from 12 peers it answers
// maxPunching (8), the others get 429 rate_limited with Retry-After, a
// peer's second offer while its first is punched too; meanwhile the node
// serves a session's hops through the relay. Each answered offer sends
// exactly punchesPerOffer 20-byte punches to its candidate, and once the
// punching is over a new peer's offer is answered again.
func TestPunchOffersAreLimited(t *testing.T) {
	testenv.CheckGoroutines(t)
	p := newRelayedPair(t)
	sink := newPunchSink(t)
	to := sink.pc.LocalAddr().String()
	const offers = 12
	peers := make([]*relay.Client, offers)
	for i := range peers {
		peers[i] = p.peer(t)
	}
	type result struct {
		status     int
		retryAfter string
		body       []byte
	}
	results := make([]result, offers)
	var wg sync.WaitGroup
	for i := range peers {
		wg.Go(func() {
			s, ra, b := p.offer(t, peers[i], offerBody(byte(i+1), to))
			results[i] = result{s, ra, b}
		})
	}
	wg.Wait()
	answered := 0
	var refused *relay.Client
	for i, r := range results {
		switch r.status {
		case http.StatusOK:
			answered++
			var ans wire.PunchAnswer
			if json.Unmarshal(r.body, &ans) != nil || len(ans.Candidates) == 0 {
				t.Fatalf("offer %d answered %s, want the tail's candidates", i, r.body)
			}
			if refused == nil && answered == 1 {
				// Its second offer, while the first is punched: one per peer.
				s, _, b := p.offer(t, peers[i], offerBody(0x77, to))
				wantAPIError(t, "a peer's second offer", s, b, http.StatusTooManyRequests, "rate_limited")
			}
		default:
			wantAPIError(t, fmt.Sprintf("offer %d", i), r.status, r.body, http.StatusTooManyRequests, "rate_limited")
			if r.retryAfter == "" {
				t.Fatalf("offer %d: 429 without Retry-After", i)
			}
			refused = peers[i]
		}
	}
	if answered != maxPunching {
		t.Fatalf("%d of %d concurrent offers answered, want %d", answered, offers, maxPunching)
	}
	// The punch slots are full: the node still serves hops.
	pl, _ := ticketedPipeline(t, p.head, []wire.Hop{p.hop})
	if ids, ae := sixSteps(pl); ae != nil || !equalIDs(ids, sixStepsWant(), len(sixStepsWant())) {
		t.Fatalf("a session while the punch slots are full: %v %v, want %v", ids, ae, sixStepsWant())
	}
	// Once the punching is over, a refused peer is answered.
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		s, _, b := p.offer(t, refused, offerBody(0x99, to))
		if s == http.StatusOK {
			break
		}
		wantAPIError(t, "an offer after the punching", s, b, http.StatusTooManyRequests, "rate_limited")
		if time.Now().After(deadline) {
			t.Fatal("no offer answered 15 s after the first ones")
		}
	}
	// Each answered offer punched its candidate exactly punchesPerOffer
	// times (the last one's punches may still be under way).
	time.Sleep(punchDelay + punchFor + time.Second)
	by, bad := sink.counts()
	if bad != 0 {
		t.Fatalf("the candidate got %d packets that are no 20-byte punch", bad)
	}
	if len(by) != maxPunching+1 {
		t.Fatalf("punches carried %d nonces, want the %d answered offers'", len(by), maxPunching+1)
	}
	for nonce, n := range by {
		if n != punchesPerOffer {
			t.Fatalf("offer %s…: %d punches to its candidate, want %d", nonce[:4], n, punchesPerOffer)
		}
	}
}

// An offer the node must not act on gets a 4xx JSON error and no punch:
// one over HTTP rather than through the relay, one over 2 KiB, a bad
// nonce, too many candidates, and each kind of address a punch may not go
// to. A good offer from the same peer is answered afterwards.
func TestPunchOffersOutOfBoundsAreRefused(t *testing.T) {
	testenv.CheckGoroutines(t)
	p := newRelayedPair(t)
	sink := newPunchSink(t)
	to := sink.pc.LocalAddr().String()
	rc := p.peer(t)
	// Over HTTP: the relay names no source peer.
	u, _ := serve(t, p.tail.Handler())
	resp, err := http.Post(u+wire.PunchPath, "application/json", bytes.NewReader(offerBody(1, to)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	wantAPIError(t, "an offer over HTTP", resp.StatusCode, b, http.StatusForbidden, "forbidden")

	big := offerBody(1, to)
	big = append(big[:len(big)-1], []byte(`,"pad":"`+strings.Repeat("x", wire.MaxPunchBody)+`"}`)...)
	s, _, b := p.offer(t, rc, big)
	wantAPIError(t, "an offer over 2 KiB", s, b, http.StatusRequestEntityTooLarge, "too_large")

	nine := make([]string, wire.MaxPunchCandidates+1)
	for i := range nine {
		nine[i] = fmt.Sprintf("127.0.0.%d:9", i+1)
	}
	bad := map[string][]byte{
		"a short nonce":    []byte(`{"nonce":"abcd","candidates":["` + to + `"]}`),
		"no candidates":    offerBody(1),
		"nine candidates":  offerBody(1, nine...),
		"multicast":        offerBody(1, "224.0.0.1:9"),
		"broadcast":        offerBody(1, "255.255.255.255:9"),
		"link-local":       offerBody(1, "169.254.1.1:9"),
		"IPv6 link-local":  offerBody(1, "[fe80::1]:9"),
		"IPv6 multicast":   offerBody(1, "[ff02::1]:9"),
		"unspecified":      offerBody(1, "0.0.0.0:9"),
		"port 0":           offerBody(1, "127.0.0.1:0"),
		"a name":           offerBody(1, "localhost:9"),
		"a good and a bad": offerBody(1, to, "224.0.0.1:9"),
		"a TCP multicast":  withTCP(offerBody(1, to), "224.0.0.1:9"),
		"a TCP name":       withTCP(offerBody(1, to), "localhost:9"),
		"a TCP port 0":     withTCP(offerBody(1, to), "127.0.0.1:0"),
		"two TCP":          withTCP(offerBody(1, to), `127.0.0.1:9","127.0.0.1:10`),
	}
	for what, body := range bad {
		s, _, b := p.offer(t, rc, body)
		wantAPIError(t, what, s, b, http.StatusBadRequest, wire.TypeInvalidRequest)
	}
	time.Sleep(300 * time.Millisecond) // low-TTL punches go at once
	if by, junk := sink.counts(); len(by) != 0 || junk != 0 {
		t.Fatalf("refused offers made the node punch: %v, %d others", by, junk)
	}
	if s, _, b := p.offer(t, rc, offerBody(2, to)); s != http.StatusOK {
		t.Fatalf("a good offer after the bad ones: %d %s", s, b)
	}
}

// withTCP adds a punched TCP candidate to an offer's JSON.
func withTCP(offer []byte, c string) []byte {
	return append(offer[:len(offer)-1], []byte(`,"tcp":["`+c+`"]}`)...)
}
