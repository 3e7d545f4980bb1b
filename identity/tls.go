package identity

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"time"
)

// CertValidity is how long a node's self-signed certificate is valid; it is
// made afresh at every start, so nothing needs renewing.
const CertValidity = 30 * 24 * time.Hour

// Certificate makes a self-signed X.509 certificate for the identity's
// Ed25519 key. It names no host: a client checks the key against the peer
// id it expects (ClientTLSConfig), as libp2p's TLS handshake does, so no CA
// and no certificate files are involved.
func (id *Identity) Certificate(now time.Time) (tls.Certificate, error) {
	return id.certificate(now.Add(-time.Hour), now.Add(CertValidity))
}

func (id *Identity) certificate(notBefore, notAfter time.Time) (tls.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: id.PeerID},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, id.Public, id.Private)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("identity: certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: id.Private, Leaf: leaf}, nil
}

// ServerTLSConfig serves TLS 1.3 with the identity's self-signed
// certificate.
func (id *Identity) ServerTLSConfig(now time.Time) (*tls.Config, error) {
	cert, err := id.Certificate(now)
	if err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}, nil
}

// ClientTLSConfig accepts exactly the server whose certificate carries the
// Ed25519 key that peerID is derived from. Chain verification against CAs
// is off (InsecureSkipVerify) and replaced by VerifyConnection, which runs
// on every handshake, resumed ones included; TLS's CertificateVerify has
// already proved that the server holds the key. clock may be nil
// (time.Now).
func ClientTLSConfig(peerID string, clock func() time.Time) *tls.Config {
	if clock == nil {
		clock = time.Now
	}
	return &tls.Config{
		MinVersion:         tls.VersionTLS13,
		InsecureSkipVerify: true, // replaced by VerifyConnection below
		VerifyConnection: func(cs tls.ConnectionState) error {
			return VerifyPeerCertificate(cs.PeerCertificates, peerID, clock())
		},
	}
}

// ErrWrongPeer is a TLS peer whose key is not the expected peer id's.
var ErrWrongPeer = errors.New("identity: TLS peer is not the expected peer id")

// VerifyPeerCertificate checks that certs is one self-signed, currently
// valid Ed25519 certificate whose key hashes to peerID.
func VerifyPeerCertificate(certs []*x509.Certificate, peerID string, now time.Time) error {
	if len(certs) != 1 {
		return fmt.Errorf("identity: TLS peer presented %d certificates, want 1", len(certs))
	}
	c := certs[0]
	pub, ok := c.PublicKey.(ed25519.PublicKey)
	if !ok {
		return fmt.Errorf("identity: TLS peer key is %T, want Ed25519", c.PublicKey)
	}
	if got := PeerID(pub); got != peerID {
		return fmt.Errorf("%w: presented %s, want %s", ErrWrongPeer, got, peerID)
	}
	if now.Before(c.NotBefore) || now.After(c.NotAfter) {
		return fmt.Errorf("identity: TLS certificate of %s is valid %s to %s, not now", peerID,
			c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339))
	}
	if err := c.CheckSignature(c.SignatureAlgorithm, c.RawTBSCertificate, c.Signature); err != nil {
		return fmt.Errorf("identity: TLS certificate of %s is not self-signed by its key: %w", peerID, err)
	}
	return nil
}
