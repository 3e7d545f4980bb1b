package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"testing"
	"time"
)

// BenchmarkTLSHandshake compares one TLS 1.3 handshake on 127.0.0.1 with
// the pinned Ed25519 identity certificate against the usual scheme (an
// ECDSA P-256 certificate verified against a CA pool), in the same run:
// report the ratio, not the times (docs/performance.md).
func BenchmarkTLSHandshake(b *testing.B) {
	id, err := New()
	if err != nil {
		b.Fatal(err)
	}
	pinnedServer, err := id.ServerTLSConfig(time.Now())
	if err != nil {
		b.Fatal(err)
	}
	ecdsaCert, pool := ecdsaCA(b)
	for _, tc := range []struct {
		name           string
		server, client *tls.Config
	}{
		{"ecdsa-p256-ca", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{ecdsaCert}},
			&tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: "127.0.0.1"}},
		{"ed25519-pinned", pinnedServer, ClientTLSConfig(id.PeerID, nil)},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ln, err := tls.Listen("tcp", "127.0.0.1:0", tc.server)
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					go func() {
						defer c.Close()
						c.(*tls.Conn).Handshake()
						io.Copy(io.Discard, c)
					}()
				}
			}()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				c, err := tls.Dial("tcp", ln.Addr().String(), tc.client)
				if err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		})
	}
}

func ecdsaCA(b *testing.B) (tls.Certificate, *x509.CertPool) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		b.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "bench"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		b.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}
