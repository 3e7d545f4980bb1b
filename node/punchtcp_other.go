//go:build !linux

package node

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
)

// Punched TCP paths are Linux only; elsewhere direct paths are QUIC.
const tcpPunchSupported = false

var errNoTCPPunch = errors.New("punched TCP paths are Linux only")

func punchControl(string, string, syscall.RawConn) error { return errNoTCPPunch }

func synLowTTL(*net.TCPAddr, netip.AddrPort) error { return errNoTCPPunch }
