package tracker

import (
	"crypto/ed25519"
	"encoding/hex"
	"testing"
	"time"

	"meshgpu/identity"
)

// The canonical form is specified in docs/tracker.md; this checks the
// implementation against a hand-written instance of that spec.
func TestCanonicalMatchesTheDocumentedForm(t *testing.T) {
	body := `{ "b": 1, "a": {"y": "<&>", "x": 1.50e0}, "signature": "abcd", "kind": "heartbeat" }`
	want := `{"a":{"x":1.50e0,"y":"<&>"},"b":1,"kind":"heartbeat","signature":""}`
	got, err := Canonical([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("canonical\n got %s\nwant %s", got, want)
	}
	for _, bad := range []string{`[1]`, `{"a":1} {"b":2}`, `{"a":`, `null`} {
		if _, err := Canonical([]byte(bad)); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

// A message signed by hand as the docs describe (no tracker code on the
// signing side) is accepted; changing any byte is not.
func TestHandSignedMessageVerifies(t *testing.T) {
	id := newIdentity(t)
	now := time.Unix(1_800_000_000, 0)
	unsigned := `{"free_memory":5,"kind":"heartbeat","peer_id":"` + id.PeerID + `","public_key":"` + hex.EncodeToString(id.Public) +
		`","signature":"","stats":{"rpm1":1.5},"timestamp":1800000000000}`
	sig := hex.EncodeToString(ed25519.Sign(id.Private, []byte("meshgpu-tracker-v1\n"+unsigned)))
	signed := `{"kind":"heartbeat","peer_id":"` + id.PeerID + `","public_key":"` + hex.EncodeToString(id.Public) +
		`","timestamp":1800000000000,"free_memory":5,"stats":{"rpm1":1.5},"signature":"` + sig + `"}`
	var hb Heartbeat
	if err := verify([]byte(signed), KindHeartbeat, now, 2*time.Minute, &hb); err != nil {
		t.Fatalf("hand-signed heartbeat refused: %v", err)
	}
	if hb.FreeMemory != 5 || hb.Stats.RPM1 != 1.5 {
		t.Fatalf("decoded %+v", hb)
	}
	for _, mutate := range []func(string) string{
		func(s string) string { // last signature digit
			d := "0"
			if s[len(s)-3] == '0' {
				d = "1"
			}
			return s[:len(s)-3] + d + `"}`
		},
		func(s string) string { return replaceOnce(s, `"free_memory":5`, `"free_memory":6`) },            // body
		func(s string) string { return replaceOnce(s, `"stats":{"rpm1":1.5}`, `"stats":{"rpm1":1.50}`) }, // number text
	} {
		var hb Heartbeat
		if err := verify([]byte(mutate(signed)), KindHeartbeat, now, 2*time.Minute, &hb); err == nil {
			t.Errorf("mutated message accepted: %s", mutate(signed))
		}
	}
	if err := verify([]byte(signed), KindHeartbeat, now.Add(3*time.Minute), 2*time.Minute, &hb); err == nil {
		t.Error("3-minute-old message accepted")
	}
}

func replaceOnce(s, old, new string) string {
	for i := 0; i+len(old) <= len(s); i++ {
		if s[i:i+len(old)] == old {
			return s[:i] + new + s[i+len(old):]
		}
	}
	panic("not found: " + old)
}

// FuzzVerify: hostile bodies are refused with an error, never a panic.
func FuzzVerify(f *testing.F) {
	id, _ := identityForFuzz()
	good, _ := Sign(id, KindHeartbeat, time.Unix(1_800_000_000, 0), &Heartbeat{FreeMemory: 1})
	for _, s := range []string{string(good), "null", "[]", `{"signature":5}`, `{"kind":"heartbeat","public_key":"zz"}`, `{"a":{"b":[1,2,{"c":null}]}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var hb Heartbeat
		_ = verify(body, KindHeartbeat, time.Unix(1_800_000_000, 0), 2*time.Minute, &hb)
		var reg Registration
		if verify(body, KindRegister, time.Unix(1_800_000_000, 0), 2*time.Minute, &reg) == nil {
			_ = reg.validate()
		}
	})
}

func identityForFuzz() (*identity.Identity, error) { return identity.New() }
