package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// serveTLS runs an HTTPS server with cfg on 127.0.0.1 and returns its URL.
func serveTLS(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }),
		TLSConfig: cfg, ReadHeaderTimeout: 5 * time.Second, ErrorLog: log.New(io.Discard, "", 0)}
	done := make(chan struct{})
	go func() { defer close(done); hs.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { hs.Close(); <-done })
	return "https://" + ln.Addr().String()
}

func get(t *testing.T, url string, cfg *tls.Config) (string, error) {
	t.Helper()
	tr := &http.Transport{TLSClientConfig: cfg}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestTLSPinnedToPeerID(t *testing.T) {
	server, impostor := mustNew(t), mustNew(t)
	cfg, err := server.ServerTLSConfig(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	url := serveTLS(t, cfg)
	if body, err := get(t, url, ClientTLSConfig(server.PeerID, nil)); err != nil || body != "hello" {
		t.Fatalf("the expected peer: %q, %v", body, err)
	}
	// A client expecting another peer id at this address refuses it: the
	// server's key is not the one in the ticket.
	_, err = get(t, url, ClientTLSConfig(impostor.PeerID, nil))
	if err == nil || !strings.Contains(err.Error(), ErrWrongPeer.Error()) {
		t.Fatalf("server with a different key accepted: %v", err)
	}
}

func TestTLSRefusesExpiredAndForeignCertificates(t *testing.T) {
	id := mustNew(t)
	now := time.Now()
	expired, err := id.certificate(now.Add(-48*time.Hour), now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	url := serveTLS(t, &tls.Config{Certificates: []tls.Certificate{expired}})
	if _, err := get(t, url, ClientTLSConfig(id.PeerID, nil)); err == nil || !strings.Contains(err.Error(), "not now") {
		t.Fatalf("expired certificate accepted: %v", err)
	}
	// The certificate is still valid on a clock from before it expired:
	// the refusal above was the expiry check, nothing else.
	if _, err := get(t, url, ClientTLSConfig(id.PeerID, func() time.Time { return now.Add(-2 * time.Hour) })); err != nil {
		t.Fatalf("same certificate inside its validity: %v", err)
	}

	// A certificate for an ECDSA key, whatever its name says.
	ek, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: id.PeerID},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &ek.PublicKey, ek)
	if err != nil {
		t.Fatal(err)
	}
	url = serveTLS(t, &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: ek}}})
	if _, err := get(t, url, ClientTLSConfig(id.PeerID, nil)); err == nil || !strings.Contains(err.Error(), "want Ed25519") {
		t.Fatalf("ECDSA certificate accepted: %v", err)
	}
}

func TestVerifyPeerCertificateUnit(t *testing.T) {
	id, other := mustNew(t), mustNew(t)
	now := time.Now()
	c, _ := id.Certificate(now)
	o, _ := other.Certificate(now)
	if err := VerifyPeerCertificate([]*x509.Certificate{c.Leaf}, id.PeerID, now); err != nil {
		t.Fatal(err)
	}
	if err := VerifyPeerCertificate(nil, id.PeerID, now); err == nil {
		t.Fatal("no certificate accepted")
	}
	if err := VerifyPeerCertificate([]*x509.Certificate{c.Leaf, o.Leaf}, id.PeerID, now); err == nil {
		t.Fatal("a chain accepted")
	}
	// Signed by another key than the one it carries.
	forged := *c.Leaf
	forged.Signature = o.Leaf.Signature
	if err := VerifyPeerCertificate([]*x509.Certificate{&forged}, id.PeerID, now); err == nil || errors.Is(err, ErrWrongPeer) {
		t.Fatalf("certificate with a foreign signature: %v", err)
	}
}

func mustNew(t *testing.T) *Identity {
	t.Helper()
	id, err := New()
	if err != nil {
		t.Fatal(err)
	}
	return id
}
