package node

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// tcpPunchSupported: punched TCP paths need SO_REUSEPORT, TCP_USER_TIMEOUT
// and a SYN sent with a low TTL.
const tcpPunchSupported = true

// punchControl lets the TCP punch port's listener, observations and dials
// share one local port, and makes a punched connection whose data goes
// unacknowledged for tcpUserTimeout fail (a NAT that dropped its mapping),
// so its hops go back to the relay.
func punchControl(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) { serr = setPunchOpts(int(fd)) }); err != nil {
		return err
	}
	return serr
}

func setPunchOpts(fd int) error {
	for _, o := range []int{unix.SO_REUSEADDR, unix.SO_REUSEPORT} {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, o, 1); err != nil {
			return err
		}
	}
	return unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(tcpUserTimeout/time.Millisecond))
}

// synLowTTL sends one SYN from local's port to a with a hop limit of
// punchTTL and forgets the connection (closing a connecting socket sends
// nothing): the SYN opens this node's NAT towards a and dies before a's
// NAT, which would answer it with a RST.
func synLowTTL(local *net.TCPAddr, a netip.AddrPort) error {
	family, level, opt := unix.AF_INET, unix.IPPROTO_IP, unix.IP_TTL
	var la, ra unix.Sockaddr
	if a.Addr().Is4() {
		l := &unix.SockaddrInet4{Port: local.Port}
		if ip4 := local.IP.To4(); ip4 != nil {
			l.Addr = [4]byte(ip4)
		}
		la, ra = l, &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()}
	} else {
		family, level, opt = unix.AF_INET6, unix.IPPROTO_IPV6, unix.IPV6_UNICAST_HOPS
		l := &unix.SockaddrInet6{Port: local.Port}
		if local.IP.To4() == nil && len(local.IP) == net.IPv6len {
			l.Addr = [16]byte(local.IP)
		}
		la, ra = l, &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := setPunchOpts(fd); err != nil {
		return err
	}
	if err := unix.SetsockoptInt(fd, level, opt, punchTTL); err != nil {
		return err
	}
	if err := unix.Bind(fd, la); err != nil {
		return err
	}
	// Non-blocking: connect sends the SYN and returns EINPROGRESS.
	if err := unix.Connect(fd, ra); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return err
	}
	return nil
}
