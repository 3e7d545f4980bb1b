//go:build !linux

package node

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"time"
)

// Punched TCP paths are Linux only; elsewhere direct paths are QUIC.
const tcpPunchSupported = false

var errNoTCPPunch = errors.New("punched TCP paths are Linux only")

func punchControl(string, string, syscall.RawConn) error { return errNoTCPPunch }

func punchSYN(*net.TCPAddr, netip.AddrPort) (net.Conn, error) { return nil, errNoTCPPunch }

func waitConnected(net.Conn, time.Time) error { return errNoTCPPunch }
