//go:build !linux

package node

import (
	"net"
	"net/netip"
)

// sendLowTTL is Linux only; elsewhere the full punches alone open the path.
func sendLowTTL(net.PacketConn, []byte, netip.AddrPort) {}
