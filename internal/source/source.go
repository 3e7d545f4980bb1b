// Package source names the sender of a request for per-source limits
// (the tracker's registration rate, the relay's unauthenticated
// connections).
package source

import "net/netip"

// Key is the limit key of a remote address ("host:port"): the IP, or its
// /64 for IPv6 (one host commonly holds a whole /64).
func Key(remoteAddr string) string {
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return remoteAddr
	}
	ip := ap.Addr().Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}
