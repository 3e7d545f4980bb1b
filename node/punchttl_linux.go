package node

import (
	"encoding/binary"
	"net"
	"net/netip"
	"syscall"
	"unsafe"
)

// sendLowTTL sends pkt to a with a hop limit of punchTTL (a control
// message on this packet only; QUIC's packets keep the socket's).
func sendLowTTL(pc net.PacketConn, pkt []byte, a netip.AddrPort) {
	uc, ok := pc.(*net.UDPConn)
	if !ok {
		return
	}
	level, typ := syscall.IPPROTO_IP, syscall.IP_TTL
	if !a.Addr().Is4() {
		level, typ = syscall.IPPROTO_IPV6, syscall.IPV6_HOPLIMIT
	}
	oob := make([]byte, syscall.CmsgSpace(4))
	h := (*syscall.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level, h.Type = int32(level), int32(typ)
	h.SetLen(syscall.CmsgLen(4))
	binary.NativeEndian.PutUint32(oob[syscall.CmsgLen(0):], punchTTL)
	uc.WriteMsgUDPAddrPort(pkt, oob, a)
}
