package ticket

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
)

func newKey(t testing.TB) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var now = time.UnixMilli(1_800_000_000_123)

func sample() Ticket {
	return Ticket{
		SessionID: "sess-1", Head: "mg-head",
		IssuedAt: now, Expiry: now.Add(10 * time.Minute),
		Hops: []Hop{
			{PeerID: "mg-mid", Endpoint: "http://127.0.0.1:7002", First: 2, Last: 3},
			{PeerID: "mg-tail", RelayAddr: "ws://127.0.0.1:7200/rpc/mg-tail", First: 4, Last: 5},
		},
	}
}

func mustSign(t *testing.T, tk Ticket, k ed25519.PrivateKey) []byte {
	t.Helper()
	raw, err := Sign(tk, k)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func TestSignVerifyRoundTrip(t *testing.T) {
	k := newKey(t)
	raw := mustSign(t, sample(), k)
	got, err := Verify(raw, NewTrusted(k.Public().(ed25519.PublicKey)), now.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	want := sample()
	if got.SessionID != want.SessionID || got.Head != want.Head || !got.IssuedAt.Equal(want.IssuedAt) ||
		!got.Expiry.Equal(want.Expiry) || len(got.Hops) != 2 || got.Hops[1] != want.Hops[1] {
		t.Fatalf("decoded %+v, want %+v", got, want)
	}
	if !bytes.Equal(got.Encode(), raw) {
		t.Fatal("re-encoding a parsed ticket changed its bytes")
	}
	s := String(raw)
	back, err := FromString(s)
	if err != nil || !bytes.Equal(back, raw) {
		t.Fatalf("string form does not round-trip: %v", err)
	}
	if err := got.CheckSession("sess-1"); err != nil {
		t.Fatal(err)
	}
	if err := got.CheckHead("mg-head"); err != nil {
		t.Fatal(err)
	}
}

// Deterministic: the same ticket always encodes to the same bytes (Ed25519
// signatures are deterministic too).
func TestEncodingIsDeterministic(t *testing.T) {
	k := newKey(t)
	a, b := mustSign(t, sample(), k), mustSign(t, sample(), k)
	if !bytes.Equal(a, b) {
		t.Fatal("two signings of one ticket differ")
	}
}

func TestVerifyRefusesForgeries(t *testing.T) {
	issuer, attacker := newKey(t), newKey(t)
	trusted := NewTrusted(issuer.Public().(ed25519.PublicKey))
	good := mustSign(t, sample(), issuer)
	at := now.Add(time.Minute)

	// The attacker signs a route of their own with their key.
	own := mustSign(t, sample(), attacker)
	if _, err := Verify(own, trusted, at); !errors.Is(err, ErrUntrustedIssuer) {
		t.Errorf("ticket by an untrusted issuer: %v, want ErrUntrustedIssuer", err)
	}
	// The attacker keeps the trusted issuer's key field but signs with theirs.
	forged := bytes.Clone(own)
	copy(forged[len(forged)-96:], issuer.Public().(ed25519.PublicKey))
	if _, err := Verify(forged, trusted, at); !errors.Is(err, ErrBadSignature) {
		t.Errorf("forged signature: %v, want ErrBadSignature", err)
	}
	// A hop endpoint redirected to the attacker's listener, same length so
	// the layout still parses.
	tampered := bytes.Replace(bytes.Clone(good), []byte("127.0.0.1:7002"), []byte("127.0.0.9:7002"), 1)
	if bytes.Equal(tampered, good) {
		t.Fatal("test did not tamper")
	}
	if _, err := Verify(tampered, trusted, at); !errors.Is(err, ErrBadSignature) {
		t.Errorf("tampered hop: %v, want ErrBadSignature", err)
	}
	// A layer range changed.
	tk := sample()
	tk.Hops[0].Last, tk.Hops[1].First = 4, 5
	other := mustSign(t, tk, issuer)
	mixed := append(bytes.Clone(other[:len(other)-64]), good[len(good)-64:]...)
	if _, err := Verify(mixed, trusted, at); !errors.Is(err, ErrBadSignature) {
		t.Errorf("signature of another ticket: %v, want ErrBadSignature", err)
	}
	// Flipping any single byte is refused one way or another.
	for i := range good {
		b := bytes.Clone(good)
		b[i] ^= 0x01
		if _, err := Verify(b, trusted, at); err == nil {
			t.Fatalf("flipping byte %d still verifies", i)
		}
	}
	if _, err := Verify(good, &Trusted{}, at); !errors.Is(err, ErrUntrustedIssuer) {
		t.Errorf("empty trust set: %v", err)
	}
	if _, err := Verify(good, nil, at); !errors.Is(err, ErrUntrustedIssuer) {
		t.Errorf("nil trust set: %v", err)
	}
}

func TestVerifyTimes(t *testing.T) {
	k := newKey(t)
	trusted := NewTrusted(k.Public().(ed25519.PublicKey))
	raw := mustSign(t, sample(), k)
	exp := now.Add(10 * time.Minute)
	if _, err := Verify(raw, trusted, exp.Add(DefaultMaxSkew+time.Millisecond)); !errors.Is(err, ErrExpired) {
		t.Errorf("after expiry+skew: %v, want ErrExpired", err)
	}
	if _, err := Verify(raw, trusted, exp.Add(DefaultMaxSkew-time.Millisecond)); err != nil {
		t.Errorf("within the skew after expiry: %v", err)
	}
	if _, err := Verify(raw, trusted, now.Add(-DefaultMaxSkew-time.Millisecond)); !errors.Is(err, ErrNotYetValid) {
		t.Errorf("before issue-skew: %v, want ErrNotYetValid", err)
	}
	strict := NewTrusted(k.Public().(ed25519.PublicKey))
	strict.MaxSkew = time.Millisecond
	if _, err := Verify(raw, strict, exp.Add(2*time.Millisecond)); !errors.Is(err, ErrExpired) {
		t.Errorf("custom skew: %v, want ErrExpired", err)
	}
	tk := sample()
	tk.Expiry = tk.IssuedAt.Add(MaxLifetime + time.Second)
	if _, err := Sign(tk, k); !errors.Is(err, ErrMalformed) {
		t.Errorf("lifetime over the limit signed: %v", err)
	}
}

// A valid ticket of one session presented for another is refused.
func TestReplayIntoAnotherSession(t *testing.T) {
	k := newKey(t)
	raw := mustSign(t, sample(), k)
	got, err := Verify(raw, NewTrusted(k.Public().(ed25519.PublicKey)), now)
	if err != nil {
		t.Fatal(err)
	}
	if err := got.CheckSession("victim-session"); !errors.Is(err, ErrWrongSession) {
		t.Fatalf("ticket of sess-1 accepted for victim-session: %v", err)
	}
	if err := got.CheckHead("mg-mid"); !errors.Is(err, ErrWrongHead) {
		t.Fatalf("a route node accepted as head: %v", err)
	}
}

func TestNextHop(t *testing.T) {
	tk := sample()
	if !tk.IsNextHop("mg-mid", 1) || !tk.IsNextHop("mg-tail", 3) {
		t.Fatal("route nodes are not next hops where they should be")
	}
	if tk.IsNextHop("mg-tail", 1) || tk.IsNextHop("mg-attacker", 3) || tk.IsNextHop("mg-tail", 5) {
		t.Fatal("a peer that is not next is reported next")
	}
	if _, ok := tk.NextHop(5); ok {
		t.Fatal("the tail has a next hop")
	}
	if _, err := tk.HopOf("mg-tail", 4); err != nil {
		t.Fatal(err)
	}
	if _, err := tk.HopOf("mg-tail", 2); !errors.Is(err, ErrNotOnRoute) {
		t.Fatalf("hop at the wrong layer: %v", err)
	}
}

func TestBounds(t *testing.T) {
	k := newKey(t)
	cases := map[string]func(*Ticket){
		"long session id":   func(tk *Ticket) { tk.SessionID = strings.Repeat("s", MaxSessionID+1) },
		"empty session id":  func(tk *Ticket) { tk.SessionID = "" },
		"no hops":           func(tk *Ticket) { tk.Hops = nil },
		"gap between hops":  func(tk *Ticket) { tk.Hops[1].First = 5 },
		"no address":        func(tk *Ticket) { tk.Hops[0].Endpoint = "" },
		"query in endpoint": func(tk *Ticket) { tk.Hops[0].Endpoint = "http://127.0.0.1:9/x?y=1" },
		"ftp endpoint":      func(tk *Ticket) { tk.Hops[0].Endpoint = "ftp://127.0.0.1:9" },
		"http relay":        func(tk *Ticket) { tk.Hops[1].RelayAddr = "http://127.0.0.1:9" },
		"user info":         func(tk *Ticket) { tk.Hops[0].Endpoint = "http://a@127.0.0.1:9" },
		"long endpoint":     func(tk *Ticket) { tk.Hops[0].Endpoint = "http://" + strings.Repeat("a", MaxAddr) },
		"too many hops": func(tk *Ticket) {
			tk.Hops = nil
			for i := 0; i <= MaxHops; i++ {
				tk.Hops = append(tk.Hops, Hop{PeerID: "mg-x", Endpoint: "http://127.0.0.1:9", First: i, Last: i})
			}
		},
		"expiry before issue": func(tk *Ticket) { tk.Expiry = tk.IssuedAt.Add(-time.Second) },
	}
	for name, mutate := range cases {
		tk := sample()
		mutate(&tk)
		if _, err := Sign(tk, k); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: Sign gave %v, want ErrMalformed", name, err)
		}
	}
	if _, err := Parse(make([]byte, MaxSize+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized: %v, want ErrTooLarge", err)
	}
	if _, err := FromString(strings.Repeat("A", 2*MaxSize)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized string: %v, want ErrTooLarge", err)
	}
	raw := mustSign(t, sample(), k)
	if _, err := Parse(append(bytes.Clone(raw), 0)); !errors.Is(err, ErrMalformed) {
		t.Errorf("trailing byte: %v", err)
	}
	if _, err := Parse(raw[:len(raw)-1]); !errors.Is(err, ErrMalformed) {
		t.Errorf("truncated: %v", err)
	}
	// A hop count claiming more hops than allowed is refused before any
	// allocation for them.
	big := bytes.Clone(raw)
	off := 4 + 1 + 2 + len("sess-1") + 2 + len("mg-head") + 16
	big[off], big[off+1] = 0xff, 0xff
	if _, err := Parse(big); !errors.Is(err, ErrMalformed) {
		t.Errorf("hop count 65535: %v", err)
	}
	// A ticket of MaxHops full-size hops fits MaxSize.
	tk := sample()
	tk.Hops = nil
	long := "http://" + strings.Repeat("h", MaxAddr-len("http://"))
	longWS := "ws://" + strings.Repeat("r", MaxAddr-len("ws://"))
	for i := 0; i < MaxHops; i++ {
		tk.Hops = append(tk.Hops, Hop{PeerID: strings.Repeat("p", MaxPeerID), Endpoint: long, RelayAddr: longWS, First: i, Last: i})
	}
	tk.SessionID, tk.Head = strings.Repeat("s", MaxSessionID), strings.Repeat("h", MaxPeerID)
	full := mustSign(t, tk, k)
	if _, err := Verify(full, NewTrusted(k.Public().(ed25519.PublicKey)), now); err != nil {
		t.Fatalf("largest ticket: %v (%d bytes, MaxSize %d)", err, len(full), MaxSize)
	}
}

func FuzzParse(f *testing.F) {
	k := newKey(f)
	raw, err := Sign(sample(), k)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(raw)
	f.Add([]byte("MGRT\x01"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		tk, err := Parse(b)
		if err != nil {
			return
		}
		// Canonical: what parses re-encodes to the same bytes.
		if !bytes.Equal(tk.Encode(), b) {
			t.Fatalf("parse/encode is not the identity on %x", b)
		}
		// Never verifies under a key that did not sign it.
		if _, err := Verify(b, NewTrusted(k.Public().(ed25519.PublicKey)), now); err == nil && !bytes.Equal(b, raw) {
			t.Fatalf("fuzzed ticket verifies: %x", b)
		}
	})
}

// A ticket opens Choices sessions: the id itself for one, ID:0..ID:n-1
// for more, in canonical decimal only; the count is signed (a flip of it
// breaks the signature, TestVerifyRefusesForgeries' byte flips).
func TestChoicesBoundSessions(t *testing.T) {
	k := newKey(t)
	one, err := Parse(mustSign(t, sample(), k))
	if err != nil {
		t.Fatal(err)
	}
	if one.Choices != 1 || !one.Covers("sess-1") || one.Covers("sess-1:0") || one.Covers("sess-1:1") {
		t.Fatalf("a one-choice ticket (choices %d) must cover exactly its id", one.Choices)
	}
	tk := sample()
	tk.Choices = 3
	three, err := Verify(mustSign(t, tk, k), NewTrusted(k.Public().(ed25519.PublicKey)), now)
	if err != nil || three.Choices != 3 {
		t.Fatalf("three choices: %v, %+v", err, three)
	}
	opened := 0
	for i := range 100 {
		if three.Covers("sess-1:" + itoa(i)) {
			opened++
		}
	}
	if opened != 3 {
		t.Fatalf("a 3-choice ticket opened %d of sess-1:0..99", opened)
	}
	for _, id := range []string{"sess-1", "sess-1:3", "sess-1:01", "sess-1:00", "sess-1:+1", "sess-1:-0", "sess-1:" + strings.Repeat("0", 100), "sess-1:", "sess-1x:0"} {
		if three.Covers(id) {
			t.Errorf("a 3-choice ticket covers %q", id)
		}
	}
	for _, n := range []int{-1, MaxChoices + 1} {
		tk.Choices = n
		if _, err := Sign(tk, k); !errors.Is(err, ErrMalformed) {
			t.Errorf("signing %d choices: %v, want malformed", n, err)
		}
	}
}

// A version 1 ticket (before choices) still verifies, as one session, and
// re-encodes byte for byte.
func TestVersion1StillParses(t *testing.T) {
	k := newKey(t)
	tk := sample()
	tk.Issuer, tk.version, tk.Choices = k.Public().(ed25519.PublicKey), 1, 1
	body := tk.body()
	raw := append(body, ed25519.Sign(k, signed(body))...)
	if raw[4] != 1 {
		t.Fatalf("version byte %d", raw[4])
	}
	got, err := Verify(raw, NewTrusted(k.Public().(ed25519.PublicKey)), now)
	if err != nil {
		t.Fatal(err)
	}
	if got.Choices != 1 || !got.Covers("sess-1") || got.Covers("sess-1:0") || !bytes.Equal(got.Encode(), raw) {
		t.Fatalf("v1 ticket: choices %d, re-encoded equal %v", got.Choices, bytes.Equal(got.Encode(), raw))
	}
}

// The rolling upgrade: a node of the version before choices reads only
// version 1 and refuses anything else with 403 invalid_ticket, which the
// tracker took for the node's failure and banned it. A one-choice ticket
// means the same in both versions, so Sign writes it as version 1: byte
// for byte what such a node verifies. More choices need version 2.
func TestOneChoiceTicketIsVersion1(t *testing.T) {
	k := newKey(t)
	trusted := NewTrusted(k.Public().(ed25519.PublicKey))
	for _, choices := range []int{0, 1} {
		tk := sample()
		tk.Choices = choices
		raw := mustSign(t, tk, k)
		if raw[4] != 1 {
			t.Fatalf("a ticket of %d choices signed as version %d; a node that reads only version 1 refuses it", choices, raw[4])
		}
		old := sample()
		old.Issuer, old.version, old.Choices = k.Public().(ed25519.PublicKey), 1, 1
		if body := old.body(); !bytes.Equal(raw[:len(raw)-ed25519.SignatureSize], body) {
			t.Fatalf("one-choice ticket is not the version 1 encoding:\n%x\n%x", raw, body)
		}
		got, err := Verify(raw, trusted, now)
		if err != nil || got.Choices != 1 || !got.Covers("sess-1") || got.Covers("sess-1:0") {
			t.Fatalf("one-choice ticket: %v, %+v", err, got)
		}
	}
	tk := sample()
	tk.Choices = 2
	if raw := mustSign(t, tk, k); raw[4] != 2 {
		t.Fatalf("a two-choice ticket without the head's address signed as version %d, want 2", raw[4])
	}
}

// Version 3 names how the tail reaches the head; the address is signed
// (a node on the route that rewrites it breaks the signature), and a
// ticket without it stays version 1 or 2 for the nodes that read only those.
func TestHeadAddressIsSignedVersion3(t *testing.T) {
	k := newKey(t)
	trusted := NewTrusted(k.Public().(ed25519.PublicKey))
	tk := sample()
	tk.HeadEndpoint, tk.HeadRelay = "http://127.0.0.1:7001", "ws://127.0.0.1:7200/rpc/mg-head"
	raw := mustSign(t, tk, k)
	if raw[4] != 3 {
		t.Fatalf("a ticket naming the head's address signed as version %d, want 3", raw[4])
	}
	got, err := Verify(raw, trusted, now)
	if err != nil || got.HeadEndpoint != tk.HeadEndpoint || got.HeadRelay != tk.HeadRelay || got.Choices != 1 {
		t.Fatalf("version 3 round trip: %v, %+v", err, got)
	}
	if !bytes.Equal(got.Encode(), raw) {
		t.Fatal("version 3 does not re-encode canonically")
	}
	// A node on the route points the replies at itself.
	i := bytes.Index(raw, []byte("127.0.0.1:7001"))
	forged := bytes.Clone(raw)
	copy(forged[i:], "127.0.0.1:6666")
	if _, err := Verify(forged, trusted, now); !errors.Is(err, ErrBadSignature) {
		t.Fatalf("redirected head endpoint: %v, want ErrBadSignature", err)
	}
	for _, bad := range []string{"ftp://x", "http://a@b", "http://x?y"} {
		tk.HeadEndpoint = bad
		if _, err := Sign(tk, k); !errors.Is(err, ErrMalformed) {
			t.Errorf("head endpoint %q signed: %v", bad, err)
		}
	}
	// A version 2 ticket cannot carry the fields (its encoding has none).
	v2 := sample()
	v2.Issuer, v2.version, v2.Choices, v2.HeadEndpoint = k.Public().(ed25519.PublicKey), 2, 1, "http://127.0.0.1:1"
	if err := v2.validate(); !errors.Is(err, ErrMalformed) {
		t.Fatalf("version 2 with a head endpoint validated: %v", err)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }
