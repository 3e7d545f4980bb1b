package wire

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestVariantValidate(t *testing.T) {
	fp := strings.Repeat("0123456789abcdef", 4)
	for _, v := range []Variant{{}, {Fingerprint: fp}, {Label: "Q4_K_M", Fingerprint: fp}, {Label: "bf16+x.1-2", Fingerprint: fp}} {
		if err := v.Validate(); err != nil {
			t.Errorf("%+v: %v", v, err)
		}
	}
	for _, v := range []Variant{
		{Label: "bf16"},                                   // a label names nothing without a fingerprint
		{Fingerprint: fp[:63]},                            // short
		{Fingerprint: strings.ToUpper(fp)},                // upper case
		{Fingerprint: fp[:62] + "zz"},                     // not hex
		{Label: "<b>", Fingerprint: fp},                   // markup
		{Label: "two words", Fingerprint: fp},             // space
		{Label: strings.Repeat("x", 33), Fingerprint: fp}, // long
	} {
		if err := v.Validate(); err == nil {
			t.Errorf("%+v accepted", v)
		}
	}
}

// The empty variant is absent from JSON (an older node's registration
// reads the same), and variants compare by fingerprint only.
func TestVariantJSONAndSame(t *testing.T) {
	type msg struct {
		Model   string  `json:"model"`
		Variant Variant `json:"variant,omitzero"`
	}
	b, _ := json.Marshal(msg{Model: "m"})
	if string(b) != `{"model":"m"}` {
		t.Errorf("empty variant: %s", b)
	}
	fp := strings.Repeat("ab", 32)
	b, _ = json.Marshal(msg{Model: "m", Variant: Variant{Label: "f32", Fingerprint: fp}})
	if string(b) != `{"model":"m","variant":{"label":"f32","fingerprint":"`+fp+`"}}` {
		t.Errorf("variant: %s", b)
	}
	if !(Variant{Label: "a", Fingerprint: fp}).Same(Variant{Label: "b", Fingerprint: fp}) || (Variant{}).Same(Variant{Fingerprint: fp}) || !(Variant{}).Same(Variant{}) {
		t.Error("Same compares fingerprints")
	}
	if s := (Variant{Label: "f32", Fingerprint: fp}).String(); s != "f32 (abababab)" {
		t.Errorf("String: %q", s)
	}
}
