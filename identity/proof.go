package identity

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ProofPath is the node endpoint that answers an identity challenge:
// GET /identity?nonce=N&endpoint=E&tracker=T. A tracker sends it to the
// endpoint (or through the relay) a node registered, before routing to it.
const ProofPath = "/identity"

// ProofPrefix starts the signed message, so a proof signature is never a
// valid signature of any other meshgpu message.
const ProofPrefix = "meshgpu-identity-v1\n"

// MaxProofField bounds each challenge field a node signs.
const MaxProofField = 2048

// Proof is a node's answer to an identity challenge: its key, the model
// and layers it serves, and its signature over the challenge.
type Proof struct {
	PeerID    string `json:"peer_id"`
	PublicKey string `json:"public_key"` // hex
	Nonce     string `json:"nonce"`
	Endpoint  string `json:"endpoint"` // the address the tracker reached it at
	Tracker   string `json:"tracker"`  // the challenging tracker's peer id
	Model     string `json:"model"`
	Layers    [2]int `json:"layers"` // first, last (inclusive), as /health says
	Signature string `json:"signature"`
}

// CheckChallenge refuses a challenge field a node should not sign.
func CheckChallenge(fields ...string) error {
	for _, f := range fields {
		if len(f) > MaxProofField || strings.ContainsAny(f, "\n\r\x00") {
			return fmt.Errorf("challenge field longer than %d bytes or with a line break", MaxProofField)
		}
	}
	return nil
}

func (p *Proof) message() []byte {
	return []byte(ProofPrefix + strings.Join([]string{p.PeerID, p.Nonce, p.Endpoint, p.Tracker, p.Model,
		strconv.Itoa(p.Layers[0]), strconv.Itoa(p.Layers[1])}, "\n"))
}

// Prove answers a challenge for the identity.
func (id *Identity) Prove(nonce, endpoint, tracker, model string, layers [2]int) (Proof, error) {
	if err := CheckChallenge(nonce, endpoint, tracker, model); err != nil {
		return Proof{}, err
	}
	p := Proof{PeerID: id.PeerID, PublicKey: id.PublicHex(), Nonce: nonce, Endpoint: endpoint, Tracker: tracker, Model: model, Layers: layers}
	p.Signature = hex.EncodeToString(id.Sign(p.message()))
	return p, nil
}

// VerifyProof checks that p answers this challenge (nonce, endpoint,
// tracker) and is signed by the key of peerID.
func VerifyProof(p Proof, peerID, nonce, endpoint, tracker string) error {
	if p.PeerID != peerID {
		return fmt.Errorf("the endpoint answers as %q, not %q", p.PeerID, peerID)
	}
	if p.Nonce != nonce || p.Endpoint != endpoint || p.Tracker != tracker {
		return errors.New("the proof answers another challenge")
	}
	if err := CheckChallenge(p.Model); err != nil {
		return err
	}
	pub, err := ParsePublicHex(p.PublicKey)
	if err != nil {
		return err
	}
	sig, err := hex.DecodeString(p.Signature)
	if err != nil {
		return errors.New("proof signature is not hex")
	}
	return Verify(peerID, pub, p.message(), sig)
}
