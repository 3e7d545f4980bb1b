package relay

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"meshgpu/internal/testenv"
	"net/http"
	"reflect"
	"testing"
)

// writeEnvelope's output must be what encoding/json reads as the ADR's
// message, and parseEnvelope must read what encoding/json writes.
func TestEnvelopeAgreesWithEncodingJSON(t *testing.T) {
	body := bf16Payload(3001) // not a multiple of 3 bytes: padding
	e := &envelope{Type: typeHTTPRequest, RequestID: "r\"1\u2028", Method: "POST", Path: "/forward?x=1",
		Header: http.Header{"X-Meshnet-Shape": {"1,3001"}, "X-Multi": {"a", "b"}, "X-Bad": {"\xff\x01"}}, Body: body}
	var buf bytes.Buffer
	if err := writeEnvelope(&buf, e); err != nil {
		t.Fatal(err)
	}
	var std struct {
		Type       string            `json:"type"`
		RequestID  string            `json:"request_id"`
		Method     string            `json:"method"`
		Path       string            `json:"path"`
		Headers    map[string]string `json:"headers"`
		BodyBase64 string            `json:"body_base64"`
	}
	if err := json.Unmarshal(buf.Bytes(), &std); err != nil {
		t.Fatalf("encoding/json rejects our envelope: %v\n%.300s", err, buf.Bytes())
	}
	got, _ := base64.StdEncoding.DecodeString(std.BodyBase64)
	if std.RequestID != e.RequestID || std.Path != e.Path || !bytes.Equal(got, body) ||
		std.Headers["X-Multi"] != "a, b" || std.Headers["X-Bad"] != "\ufffd\x01" {
		t.Fatalf("encoding/json read back %+v", std)
	}

	// The other way, including escaped base64 ("\/") that some encoders write.
	std.BodyBase64 = base64.StdEncoding.EncodeToString(body)
	raw, _ := json.Marshal(map[string]any{"request_id": 42, "status": 201,
		"headers": map[string]any{"x-meshnet-shape": "1,3001", "x-list": []string{"p", "q"}}, "body_base64": std.BodyBase64})
	raw = bytes.ReplaceAll(raw, []byte("/"), []byte(`\/`))
	p, err := parseEnvelope(raw)
	if err != nil {
		t.Fatal(err)
	}
	want := http.Header{"X-Meshnet-Shape": {"1,3001"}, "X-List": {"p", "q"}}
	if p.RequestID != "42" || p.Status != 201 || !bytes.Equal(p.Body, body) || !reflect.DeepEqual(p.Header, want) {
		t.Fatalf("parsed %+v", p)
	}
	txt, _ := json.Marshal(map[string]any{"request_id": "t", "status": 200, "body": "{\"token\":5,\"text\":\"\u00e9\"}"})
	if p, err := parseEnvelope(txt); err != nil || !p.Text || string(p.Body) != `{"token":5,"text":"é"}` {
		t.Fatalf("text body: %+v %v", p, err)
	}
}

func TestEnvelopeRejectsHostileInput(t *testing.T) {
	for _, in := range []string{
		``, `[]`, `{`, `{"a"}`, `{"a":}`, `{"status":"x"}`, `{"status":1e999}`, `{"body_base64":"!!!"}`,
		`{"body_base64":5}`, `{"headers":{"a":5}}`, `{"headers":[1]}`, `{"request_id":true}`,
		`{"a":"b"} x`, `{"a":` + string(bytes.Repeat([]byte("["), 100)) + `}`, `{"a":"\`,
	} {
		if _, err := parseEnvelope([]byte(in)); err == nil {
			t.Errorf("accepted %q", in)
		}
	}
}

func FuzzParseEnvelope(f *testing.F) {
	f.Add([]byte(`{"request_id":"a","status":200,"headers":{"a":"b"},"body_base64":"AAEC"}`))
	f.Add([]byte(`{"body":"x","headers":{"a":["b","c"]}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := parseEnvelope(b)
		if err != nil {
			return
		}
		// What we accept we can write back and read again the same.
		var buf bytes.Buffer
		if err := writeEnvelope(&buf, e); err != nil {
			t.Fatal(err)
		}
		e2, err := parseEnvelope(buf.Bytes())
		if err != nil {
			t.Fatalf("re-parse: %v\n%s", err, buf.Bytes())
		}
		if !bytes.Equal(e.Body, e2.Body) || e.RequestID != e2.RequestID {
			t.Fatalf("round trip changed the envelope")
		}
	})
}

// The envelope path must not build intermediate base64 strings: writing
// allocates almost nothing, reading allocates the body once. The baseline
// is the obvious encoding/json version, measured in the same run.
func TestEnvelopeAllocationsPerHop(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	body := bf16Payload(4096) // 8 KiB
	e := &envelope{Type: typeHTTPRequest, RequestID: "0123456789abcdef", Method: "POST", Path: "/forward",
		Header: http.Header{"X-Meshnet-Shape": {"1,4096"}, "X-Meshnet-Session": {"s"}, "X-Meshnet-Start-Layer": {"3"}}, Body: body}
	var sink bytes.Buffer
	sink.Grow(64 << 10)
	writeEnvelope(&sink, e)
	msg := append([]byte(nil), sink.Bytes()...)

	allocated := func(f func()) int64 { return testenv.HeapBytesPerRun(200, f) }
	perHop := allocated(func() {
		sink.Reset()
		if err := writeEnvelope(&sink, e); err != nil {
			t.Fatal(err)
		}
		if _, err := parseEnvelope(msg); err != nil {
			t.Fatal(err)
		}
	})
	type naiveEnv struct {
		Type       string            `json:"type"`
		RequestID  string            `json:"request_id"`
		Method     string            `json:"method"`
		Path       string            `json:"path"`
		Headers    map[string]string `json:"headers"`
		BodyBase64 string            `json:"body_base64"`
	}
	naive := allocated(func() {
		out, _ := json.Marshal(naiveEnv{Type: e.Type, RequestID: e.RequestID, Method: e.Method, Path: e.Path,
			Headers: map[string]string{"X-Meshnet-Shape": "1,4096"}, BodyBase64: base64.StdEncoding.EncodeToString(body)})
		var in naiveEnv
		json.Unmarshal(out, &in)
		base64.StdEncoding.DecodeString(in.BodyBase64)
	})
	t.Logf("bytes allocated per encode+decode of an 8 KiB hop: ours %d, encoding/json %d", perHop, naive)
	if limit := int64(len(body)) + 2048; perHop > limit {
		t.Fatalf("envelope encode+decode allocates %d B per 8 KiB hop, want <= %d (the body once)", perHop, limit)
	}
	if perHop*3 > naive {
		t.Fatalf("ours %d B/hop is not well below encoding/json's %d", perHop, naive)
	}
}
