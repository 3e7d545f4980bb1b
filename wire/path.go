package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// Direct paths between nodes behind NAT (docs/protocol.md, "Direct
// paths"). A node's path socket is one UDP socket carrying QUIC and three
// small packets of its own; the relay answers probes on a UDP port of its
// listen address. Every such packet starts with a byte whose two high bits
// are clear, which QUIC never sends (its fixed bit, RFC 9443), so one
// socket tells them apart by the first byte.
//
//	PathProbe    node → relay   0x01 "MGP" | transaction id [16] | zeros to PathProbeLen
//	PathObserved relay → node   0x02 "MGP" | transaction id [16] | port u16 | ip [4 or 16]
//	PathPunch    node → node    0x03 "MGP" | nonce [16]
//
// The relay answers only a probe of PathProbeLen bytes or more with at most
// as many bytes: an observation port reflects no more than it is sent.
// Candidates travel through the relay tunnel as POST PunchPath (JSON
// PunchOffer, answered with PunchAnswer), from the peer the relay names.
const (
	PathProbe    byte = 0x01
	PathObserved byte = 0x02
	PathPunch    byte = 0x03

	PathProbeLen = 48
	pathIDLen    = 16

	// PunchPath is where a node takes a punch offer, through the relay only.
	PunchPath = "/hop/punch"
	// ObservePath on a relay's TCP port answers the connection's source
	// address (ObservedAddr): the TCP twin of the UDP observation port.
	ObservePath = "/observe"
	// HopPunchedTCPProto is the ALPN of hop frames over a punched TCP path.
	HopPunchedTCPProto = "meshgpu-hop-punched-tcp/1"
	// HopQUICProto is the ALPN protocol of a direct path: QUIC with the
	// identity certificates (both sides pinned to peer ids), one stream
	// of hop frames per sender, framed as on GET /hop.
	HopQUICProto = "meshgpu-hop-quic/1"
	// MaxPunchCandidates bounds the addresses of an offer or an answer.
	MaxPunchCandidates = 8
	// MaxPunchBody bounds an offer's or an answer's JSON.
	MaxPunchBody = 2 << 10
)

// PathID is a probe's transaction id or a punch's nonce.
type PathID [pathIDLen]byte

var pathMagic = [3]byte{'M', 'G', 'P'}

// IsPathPacket reports whether b may be one of the packets above (and not
// QUIC).
func IsPathPacket(b []byte) bool {
	return len(b) >= 4 && b[0]&0xc0 == 0 && [3]byte(b[1:4]) == pathMagic
}

// AppendPathProbe appends a probe, padded to PathProbeLen.
func AppendPathProbe(b []byte, id PathID) []byte {
	b = append(b, PathProbe)
	b = append(b, pathMagic[:]...)
	b = append(b, id[:]...)
	return append(b, make([]byte, PathProbeLen-4-pathIDLen)...)
}

// AppendPathObserved appends the answer to probe id: the address it came from.
func AppendPathObserved(b []byte, id PathID, addr netip.AddrPort) []byte {
	b = append(b, PathObserved)
	b = append(b, pathMagic[:]...)
	b = append(b, id[:]...)
	b = binary.BigEndian.AppendUint16(b, addr.Port())
	return append(b, addr.Addr().Unmap().AsSlice()...)
}

// AppendPathPunch appends a punch carrying an offer's nonce.
func AppendPathPunch(b []byte, nonce PathID) []byte {
	b = append(b, PathPunch)
	b = append(b, pathMagic[:]...)
	return append(b, nonce[:]...)
}

// ErrPathPacket is a malformed path packet.
var ErrPathPacket = errors.New("malformed path packet")

// ParsePathPacket reads a path packet: its kind, id, and for PathObserved
// the address. A probe shorter than PathProbeLen is malformed.
func ParsePathPacket(b []byte) (kind byte, id PathID, addr netip.AddrPort, err error) {
	if !IsPathPacket(b) || len(b) < 4+pathIDLen {
		return 0, id, addr, ErrPathPacket
	}
	kind, id = b[0], PathID(b[4:4+pathIDLen])
	rest := b[4+pathIDLen:]
	switch kind {
	case PathProbe:
		if len(b) < PathProbeLen {
			return 0, id, addr, fmt.Errorf("%w: probe of %d bytes, want %d", ErrPathPacket, len(b), PathProbeLen)
		}
	case PathObserved:
		if len(rest) != 2+4 && len(rest) != 2+16 {
			return 0, id, addr, ErrPathPacket
		}
		ip, _ := netip.AddrFromSlice(rest[2:])
		addr = netip.AddrPortFrom(ip, binary.BigEndian.Uint16(rest))
	case PathPunch:
	default:
		return 0, id, addr, ErrPathPacket
	}
	return kind, id, addr, nil
}

// PunchOffer asks the peer (through the relay) to open a direct path to
// the sender: the sender's candidate addresses, and the nonce the peer's
// punches carry so the sender can tell them from other packets.
type PunchOffer struct {
	Nonce      string   `json:"nonce"` // 32 hex digits
	Candidates []string `json:"candidates"`
	// TCP is the sender's punched TCP candidate (its NAT's mapping of its
	// TCP punch port, as the relay observed it), if it has one.
	TCP []string `json:"tcp,omitempty"`
}

// PunchAnswer is the peer's candidates; it is punching towards the offer's.
type PunchAnswer struct {
	Candidates []string `json:"candidates"`
	// TCP is the peer's punched TCP candidate (its NAT's mapping of its
	// TCP punch port, as the relay observed it), when the offer had one:
	// the peer opened its NAT towards the offer's and listens there.
	TCP []string `json:"tcp,omitempty"`
}

// ObservedAddr answers GET ObservePath on a relay: the ip:port the relay
// sees the TCP connection come from.
type ObservedAddr struct {
	Addr string `json:"addr"`
}

// ParseCandidates checks a list of candidates: at most MaxPunchCandidates
// ip:port, each a unicast address a node may send punches to (no
// unspecified, multicast, broadcast or link-local address, no port 0).
func ParseCandidates(cs []string) ([]netip.AddrPort, error) {
	if len(cs) == 0 || len(cs) > MaxPunchCandidates {
		return nil, fmt.Errorf("%d candidates, want 1 to %d", len(cs), MaxPunchCandidates)
	}
	out := make([]netip.AddrPort, 0, len(cs))
	for _, c := range cs {
		ap, err := netip.ParseAddrPort(c)
		if err != nil {
			return nil, fmt.Errorf("candidate %q: %v", Truncate(c, 60), err)
		}
		ip := ap.Addr().Unmap()
		if ap.Port() == 0 || !ip.IsValid() || ip.IsUnspecified() || ip.IsMulticast() || ip.IsLinkLocalUnicast() ||
			ip.IsInterfaceLocalMulticast() || ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
			return nil, fmt.Errorf("candidate %s is not a unicast address a punch may go to", ap)
		}
		out = append(out, netip.AddrPortFrom(ip, ap.Port()))
	}
	return out, nil
}
