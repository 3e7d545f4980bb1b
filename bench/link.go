package bench

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"time"

	"meshgpu/internal/linkdelay"
	"meshgpu/internal/wirecount"
)

// link is what the hops suite's connections cross: plain loopback by
// default, or (HopsConfig.RTT, HopsConfig.TLS) a WAN-like link with an
// emulated round-trip time on every dialed connection and TLS on every
// server, as a relay on the internet is reached (ADR-0014's wss://).
type link struct {
	rtt    time.Duration
	server *tls.Config // nil: plain TCP
	client *tls.Config
}

func newLink(rtt time.Duration, useTLS bool) (link, error) {
	l := link{rtt: rtt}
	if !useTLS {
		return l, nil
	}
	cert, pool, err := selfSignedLoopbackCert()
	if err != nil {
		return l, err
	}
	l.server = &tls.Config{Certificates: []tls.Certificate{cert}}
	l.client = &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"}
	return l, nil
}

// dial connects over the link, counting the bytes that cross it in wc (may
// be nil). TLS is left to the caller (HTTP and WebSocket clients do it).
func (l link) dial(wc *wirecount.Counter) linkdelay.DialFunc {
	var base linkdelay.DialFunc
	if wc != nil {
		base = wc.Dial
	}
	if l.rtt <= 0 {
		if base == nil {
			var d net.Dialer
			return d.DialContext
		}
		return base
	}
	return (&linkdelay.Dialer{RTT: l.rtt, Dial: base}).DialContext
}

// listen listens on 127.0.0.1, behind TLS when the link has it.
func (l link) listen() (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil || l.server == nil {
		return ln, err
	}
	return tls.NewListener(ln, l.server), nil
}

// scheme is "http"/"ws", or "https"/"wss" over TLS.
func (l link) scheme(plain string) string {
	if l.server != nil {
		return plain + "s"
	}
	return plain
}

// selfSignedLoopbackCert makes an ECDSA P-256 certificate for 127.0.0.1
// (the key type most public certificates now use) and a pool trusting it.
func selfSignedLoopbackCert() (tls.Certificate, *x509.CertPool, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "meshgpu bench"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:                  true, // its own root: the clients trust exactly this certificate
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool, nil
}

// dialEcho connects to the echo server across the link (TLS when it has
// it): the raw baseline.
func (l link) dialEcho(ctx context.Context, addr string, payload []byte, wc *wirecount.Counter) (*echoConn, error) {
	c, err := l.dial(wc)(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if l.client != nil {
		tc := tls.Client(c, l.client)
		if err := tc.HandshakeContext(ctx); err != nil {
			c.Close()
			return nil, err
		}
		c = tc
	}
	return newEchoConn(c, payload), nil
}
