package ticket

import (
	"crypto/ed25519"
	"crypto/sha256"
)

// ReleaseContext separates a session release's signature from a ticket's.
const ReleaseContext = "meshgpu-session-release-v1\x00"

// releaseMessage binds a release to one session of one ticket: it frees
// nothing else, and no other ticket's session of the same id.
func releaseMessage(sessionID string, rawTicket []byte) []byte {
	d := sha256.Sum256(rawTicket)
	m := append([]byte(ReleaseContext), d[:]...)
	return append(m, sessionID...)
}

// SignRelease is the issuer's word that session sessionID of ticket
// rawTicket (which key signed) may be freed. Only the issuer can make it:
// the route's nodes hold the ticket, not the issuer's key.
func SignRelease(key ed25519.PrivateKey, sessionID string, rawTicket []byte) []byte {
	return ed25519.Sign(key, releaseMessage(sessionID, rawTicket))
}

// VerifyRelease reports whether sig is rawTicket's issuer's release of
// session sessionID.
func VerifyRelease(sessionID string, rawTicket, sig []byte) bool {
	t, err := Parse(rawTicket)
	if err != nil || len(sig) != ed25519.SignatureSize {
		return false
	}
	return ed25519.Verify(t.Issuer, releaseMessage(sessionID, rawTicket), sig)
}
