package wire

import (
	"errors"
	"fmt"
)

// Variant says which weights of a model a node holds: a Q4_K_M node and a
// Q8_0 node of one model compute different numbers, so the tracker never
// puts both in one route and audits compare only nodes of one variant.
// Nodes compute it at start-up (model.VariantOf) and send it in their
// registration and assignment request.
//
// Fingerprint identifies the variant: the hex SHA-256 of every tensor's
// name, dtype, shape and stored size and of the config fields that change
// the numerics. Label is for people ("bf16", "Q4_K_M") and is not compared.
// The zero Variant is the empty variant: a node that sent none (an older
// node, or one that could not see every tensor) is routed only with other
// such nodes.
type Variant struct {
	Label       string `json:"label,omitempty"`
	Fingerprint string `json:"fingerprint,omitempty"`
}

// Limits of a Variant's fields.
const (
	MaxVariantLabel   = 32
	FingerprintLength = 64 // hex digits of a SHA-256
)

// IsZero reports whether v is the empty variant.
func (v Variant) IsZero() bool { return v.Fingerprint == "" }

// Same reports whether a node of variant v and one of o hold the same
// weights (two empty variants count as the same).
func (v Variant) Same(o Variant) bool { return v.Fingerprint == o.Fingerprint }

// String is the label and a short fingerprint, for logs: "bf16 (3f9a2c1d)".
func (v Variant) String() string {
	if v.IsZero() {
		return "(no variant)"
	}
	short := v.Fingerprint
	if len(short) > 8 {
		short = short[:8]
	}
	if v.Label == "" {
		return short
	}
	return v.Label + " (" + short + ")"
}

// Validate checks a variant from the network: an empty one, or a
// fingerprint of 64 lower-case hex digits with an optional label of at
// most MaxVariantLabel characters of [A-Za-z0-9._+-].
func (v Variant) Validate() error {
	if v.Fingerprint == "" {
		if v.Label != "" {
			return errors.New("variant has a label but no fingerprint")
		}
		return nil
	}
	if len(v.Fingerprint) != FingerprintLength {
		return fmt.Errorf("variant fingerprint must be %d hex digits, got %d characters", FingerprintLength, len(v.Fingerprint))
	}
	for _, c := range v.Fingerprint {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return errors.New("variant fingerprint must be lower-case hex")
		}
	}
	if len(v.Label) > MaxVariantLabel {
		return fmt.Errorf("variant label is longer than %d bytes", MaxVariantLabel)
	}
	for _, c := range v.Label {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '+' || c == '-'
		if !ok {
			return errors.New("variant label must be characters of [A-Za-z0-9._+-]")
		}
	}
	return nil
}

// Response headers of the tracker's proxy: the variant that served the
// request (every choice of one request runs on one variant). Absent when
// the serving nodes sent no variant.
const (
	HeaderVariant      = "X-Meshnet-Variant"       // its fingerprint
	HeaderVariantLabel = "X-Meshnet-Variant-Label" // its label
)
