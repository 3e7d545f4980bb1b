package node

import (
	"errors"
	"net"
	"net/netip"
	"os"
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

// punchSYN starts a connection from local's port to a whose SYN has a hop
// limit of punchTTL: it opens this node's NAT towards a and dies before
// a's NAT, which would answer it with a RST. Then the socket's TTL is the
// default again and it waits in SYN-SENT: the peer's SYN, passing our NAT
// as the reply to ours, makes it a simultaneous open, so the SYN-ACK both
// NATs see carries the sequence number of the SYN they saw first (a
// listener's SYN-ACK would carry another, and conntrack, checking
// windows, would not translate it). waitConnected waits for the handshake.
func punchSYN(local *net.TCPAddr, a netip.AddrPort) (net.Conn, error) {
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
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "tcp-punch")
	defer f.Close() // net.FileConn keeps a copy
	if err := setPunchOpts(fd); err != nil {
		return nil, err
	}
	if err := unix.SetsockoptInt(fd, level, opt, punchTTL); err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, la); err != nil {
		return nil, err
	}
	// Non-blocking: connect sends the SYN and returns EINPROGRESS.
	if err := unix.Connect(fd, ra); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return nil, err
	}
	if err := unix.SetsockoptInt(fd, level, opt, -1); err != nil { // -1: the default hop limit
		return nil, err
	}
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	if err := c.(*net.TCPConn).SetKeepAliveConfig(punchKeepAlive); err != nil {
		c.Close()
		return nil, err
	}
	return &punchedConn{Conn: c, remote: net.TCPAddrFromAddrPort(a)}, nil
}

// waitConnected waits until punchSYN's connection is open (or fails, or
// the deadline passes).
func waitConnected(c net.Conn, deadline time.Time) error {
	pc := c.(*punchedConn)
	sc, err := pc.Conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		return err
	}
	pc.SetWriteDeadline(deadline)
	defer pc.SetWriteDeadline(time.Time{})
	var cerr error
	werr := sc.Write(func(fd uintptr) bool {
		if _, err := unix.Getpeername(int(fd)); err == nil {
			return true // connected
		}
		if v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR); err != nil || v != 0 {
			cerr = err
			if v != 0 {
				cerr = syscall.Errno(v)
			}
			return true
		}
		return false // still in SYN-SENT: wait until it is writable
	})
	if werr != nil {
		return werr
	}
	return cerr
}
