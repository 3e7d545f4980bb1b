package relay

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/wire"
)

// /tunnel: the binary tunnel (frames in package wire, docs/relay.md).

func (s *Server) handleTunnel(w http.ResponseWriter, r *http.Request) {
	if !s.enter() {
		writeHTTPError(w, http.StatusServiceUnavailable, "shutting_down", "relay is shutting down")
		return
	}
	defer s.wg.Done()
	ws, err := s.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return // the upgrader answered with an HTTP error
	}
	ws.SetReadLimit(int64(s.MaxFrameBytes) + 64<<10)
	pc := s.newPeerConn(ws, "tunnel", websocket.BinaryMessage)
	if !s.track(pc) {
		ws.Close()
		return
	}
	cause := s.tunnelHandshake(pc)
	if cause == nil {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); pc.c.writeLoop() }()
		if pc.accepts {
			s.register(pc)
		}
		cause = s.tunnelReadLoop(pc)
	}
	if c := pc.c.cause(); c != nil {
		cause = c
	}
	s.noteReadErr(cause)
	s.untrack(pc, cause)
}

// tunnelHandshake runs before the writer goroutine starts, so it writes
// directly.
func (s *Server) tunnelHandshake(pc *peerConn) error {
	ws := pc.c.ws
	var nonce [32]byte
	rand.Read(nonce[:])
	ch := wire.TunnelChallenge{Version: wire.TunnelVersion, Nonce: nonce}
	ws.SetWriteDeadline(time.Now().Add(s.WriteTimeout))
	if err := ws.WriteMessage(websocket.BinaryMessage, wire.Frame(wire.FrameServerChallenge, ch.Append(nil))); err != nil {
		return err
	}
	ws.SetReadDeadline(time.Now().Add(handshakeTimeout))
	typ, p, err := readOneFrame(ws, s.MaxFrameBytes)
	if err != nil {
		return err
	}
	refuse := func(code int, msg string) error {
		e := wire.TunnelError{Code: uint16(code), Message: msg}
		ws.WriteMessage(websocket.BinaryMessage, wire.Frame(wire.FrameError, e.Append(nil)))
		return errors.New(msg)
	}
	if typ != wire.FrameClientHello {
		return refuse(http.StatusBadRequest, "expected ClientHello, got "+typ.String())
	}
	h, err := wire.ParseTunnelHello(p)
	if err != nil {
		return refuse(http.StatusBadRequest, "malformed ClientHello")
	}
	if h.Version != wire.TunnelVersion {
		return refuse(http.StatusUpgradeRequired, fmt.Sprintf("unsupported tunnel version %d; this relay speaks %d", h.Version, wire.TunnelVersion))
	}
	if err := s.authenticate(h.PeerID, h.PublicKey, h.Signature, hex.EncodeToString(nonce[:]), h.JoinToken); err != nil {
		s.m.authFailures.Inc()
		s.log.Warn("tunnel registration refused", "peer_id", h.PeerID, "remote", ws.RemoteAddr().String(), "err", err)
		return refuse(err.(*authError).code, err.Error())
	}
	pc.peerID = h.PeerID
	pc.accepts = h.Flags&wire.FlagAcceptsRequests != 0
	pc.hops = pc.accepts && h.Flags&wire.FlagHopFrames != 0
	info := wire.TunnelInfo{Version: wire.TunnelVersion, MaxFrame: uint32(s.MaxFrameBytes),
		MaxInflight: uint32(s.MaxInflightPerPeer), PingIntervalMs: uint32(s.PingInterval / time.Millisecond),
		Features: wire.FeatureHopFrames}
	return ws.WriteMessage(websocket.BinaryMessage, wire.Frame(wire.FrameServerInfo, info.Append(nil)))
}

// readOneFrame reads a message holding one frame (handshake only).
func readOneFrame(ws *websocket.Conn, max int) (wire.FrameType, []byte, error) {
	mt, r, err := ws.NextReader()
	if err != nil {
		return 0, nil, err
	}
	if mt != websocket.BinaryMessage {
		return 0, nil, errors.New("tunnel: expected a binary message")
	}
	return wire.ReadFrame(r, max)
}

// floodPause is how long a tunnel's reading pauses per consecutive
// over-limit request (capped at maxFloodPause): a flooding sender still
// gets its 429s, but at the pace the relay chooses, so it cannot take the
// CPU from healthy sessions. TCP backpressure does the rest.
const (
	floodPause    = 250 * time.Microsecond
	maxFloodPause = 20 * time.Millisecond
)

func (s *Server) tunnelReadLoop(pc *peerConn) error {
	ws := pc.c.ws
	strikes := 0
	for {
		ws.SetReadDeadline(time.Now().Add(s.IdleTimeout))
		mt, r, err := ws.NextReader()
		if err != nil {
			return err
		}
		if mt != websocket.BinaryMessage {
			return errors.New("tunnel: text message on a binary tunnel")
		}
		for {
			typ, n, err := wire.ReadFrameHeader(r, s.MaxFrameBytes)
			if err == io.EOF {
				break
			}
			if err != nil {
				return err
			}
			s.countIn(wire.FrameHeaderLen + n)
			// Hop frames pass through unparsed: the relay reads the routing
			// prefix, the rest into a pooled buffer, and rewrites the prefix.
			switch typ {
			case wire.FrameHop:
				rt, rest, err := wire.ReadHopRoute(r, n)
				if err != nil {
					return fmt.Errorf("malformed Hop frame: %w", err)
				}
				buf := frames.get(rest)
				if _, err := io.ReadFull(r, *buf); err != nil {
					frames.put(buf)
					return wire.ErrShortFrame
				}
				p := &pending{srcKey: "peer:" + pc.peerID, entry: "tunnel", origin: pc, originID: rt.Stream, hop: true}
				if s.forwardHop(p, rt.Peer, buf, pc.peerID) {
					strikes++
					time.Sleep(min(time.Duration(strikes)*floodPause, maxFloodPause))
				} else {
					strikes = 0
				}
				continue
			case wire.FrameHopReply:
				var id [8]byte
				if n < len(id) {
					return fmt.Errorf("malformed HopReply frame of %d bytes", n)
				}
				if _, err := io.ReadFull(r, id[:]); err != nil {
					return wire.ErrShortFrame
				}
				buf := frames.get(n - len(id))
				if _, err := io.ReadFull(r, *buf); err != nil {
					frames.put(buf)
					return wire.ErrShortFrame
				}
				s.complete(pc, binary.BigEndian.Uint64(id[:]), result{hopReply: buf})
				continue
			}
			// A fresh buffer per frame: bodies are handed on by reference.
			if typ > wire.FrameHopReply {
				// A frame type this version does not know: skipped unread.
				if err := wire.Discard(r, n); err != nil {
					return err
				}
				continue
			}
			p, err := readPayload(r, n)
			if err != nil {
				return err
			}
			switch typ {
			case wire.FrameRequest:
				q, err := wire.ParseTunnelRequest(p)
				if err != nil {
					return fmt.Errorf("malformed Request frame: %w", err)
				}
				p := &pending{srcKey: "peer:" + pc.peerID, entry: "tunnel", origin: pc, originID: q.ID}
				if s.forward(p, q.Peer, q.Method, q.Path, q.Header, q.Body, pc.peerID) {
					strikes++
					time.Sleep(min(time.Duration(strikes)*floodPause, maxFloodPause))
				} else {
					strikes = 0
				}
			case wire.FrameResponse:
				a, err := wire.ParseTunnelResponse(p)
				if err != nil {
					return fmt.Errorf("malformed Response frame: %w", err)
				}
				s.complete(pc, a.ID, result{status: int(a.Status), header: a.Header, body: a.Body})
			case wire.FrameError:
				e, err := wire.ParseTunnelError(p)
				if err != nil {
					return fmt.Errorf("malformed Error frame: %w", err)
				}
				code := int(e.Code)
				if code < 400 || code > 599 {
					code = http.StatusBadGateway
				}
				s.complete(pc, e.ID, relayErr(code, "peer_error", "%s", e.Message))
			case wire.FrameResponseStart:
				a, err := wire.ParseTunnelResponse(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseStart frame: %w", err)
				}
				s.streamStart(pc, a)
			case wire.FrameResponseData:
				id, data, err := wire.ParseData(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseData frame: %w", err)
				}
				s.streamData(pc, id, data)
			case wire.FrameResponseEnd:
				id, err := wire.ParseID(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseEnd frame: %w", err)
				}
				s.streamEnd(pc, id)
			case wire.FramePing:
				pc.c.send(outMsg{head: wire.Frame(wire.FramePong, p)})
			case wire.FrameCancel:
				if id, err := wire.ParseID(p); err == nil {
					s.cancelFrom(pc, id)
				}
			default:
				// Pong and unknown frame types: skipped.
			}
		}
	}
}
