package testenv

import (
	"net"
	"testing"
	"time"
)

// DialerFrom dials from ip, a loopback address of its own (127.0.0.N), so
// a test can play another source address than 127.0.0.1 (per-source
// limits, an attacker beside a legitimate peer). Linux answers on all of
// 127.0.0.0/8; elsewhere (macOS) only aliases an operator added work, so
// the test is skipped when ip cannot be bound.
func DialerFrom(t testing.TB, ip string) *net.Dialer {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Skipf("source address %s is not usable here (no loopback alias?): %v", ip, err)
	}
	ln.Close()
	return &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
}
