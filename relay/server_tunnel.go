package relay

import (
	"bufio"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
)

// /tunnel: the binary tunnel (frames in package wire, docs/relay.md).

func (s *Server) handleTunnel(w http.ResponseWriter, r *http.Request) {
	if !s.enter() {
		writeHTTPError(w, http.StatusServiceUnavailable, "shutting_down", "relay is shutting down")
		return
	}
	defer s.wg.Done()
	leave, ok := s.enterUnauth(w, r)
	if !ok {
		return
	}
	defer leave()
	var pc *peerConn
	if strings.EqualFold(r.Header.Get("Upgrade"), RawTunnelUpgrade) {
		if pc = s.rawUpgrade(w, r); pc == nil {
			return
		}
	} else {
		ws, err := s.upgrader.Upgrade(w, r, nil)
		if err != nil {
			return // the upgrader answered with an HTTP error
		}
		ws.SetReadLimit(int64(s.MaxFrameBytes) + 64<<10)
		pc = s.newPeerConn(ws, "tunnel", websocket.BinaryMessage)
	}
	if !s.track(pc) {
		pc.c.close(errors.New("relay closing"))
		return
	}
	cause := s.tunnelHandshake(pc)
	if cause == nil {
		leave()
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
	c := pc.c
	var nonce [32]byte
	rand.Read(nonce[:])
	ch := hopmux.TunnelChallenge{Version: hopmux.TunnelVersion, Nonce: nonce}
	if err := c.writeNow(hopmux.Frame(hopmux.FrameServerChallenge, ch.Append(nil)), time.Now().Add(s.WriteTimeout)); err != nil {
		return err
	}
	typ, p, err := c.readNow(hopmux.MaxTunnelHello, time.Now().Add(handshakeTimeout))
	if err != nil {
		return err
	}
	refuse := func(code int, msg string) error {
		e := hopmux.TunnelError{Code: uint16(code), Message: msg}
		c.writeNow(hopmux.Frame(hopmux.FrameError, e.Append(nil)), time.Now().Add(s.WriteTimeout))
		return errors.New(msg)
	}
	if typ != hopmux.FrameClientHello {
		return refuse(http.StatusBadRequest, "expected ClientHello, got "+typ.String())
	}
	h, err := hopmux.ParseTunnelHello(p)
	if err != nil {
		return refuse(http.StatusBadRequest, "malformed ClientHello")
	}
	if h.Version != hopmux.TunnelVersion {
		return refuse(http.StatusUpgradeRequired, fmt.Sprintf("unsupported tunnel version %d; this relay speaks %d", h.Version, hopmux.TunnelVersion))
	}
	if err := s.authenticate(h.PeerID, h.PublicKey, h.Signature, hex.EncodeToString(nonce[:]), h.JoinToken); err != nil {
		s.m.authFailures.Inc()
		s.log.Warn("tunnel registration refused", "peer_id", h.PeerID, "remote", c.remoteAddr(), "err", err)
		return refuse(err.(*authError).code, err.Error())
	}
	pc.peerID, pc.srcKey = h.PeerID, "peer:"+h.PeerID
	pc.accepts = h.Flags&hopmux.FlagAcceptsRequests != 0
	pc.hops = pc.accepts && h.Flags&hopmux.FlagHopFrames != 0
	info := hopmux.TunnelInfo{Version: hopmux.TunnelVersion, MaxFrame: uint32(s.MaxFrameBytes),
		MaxInflight: uint32(s.MaxInflightPerPeer), PingIntervalMs: uint32(s.PingInterval / time.Millisecond),
		Features: hopmux.FeatureHopFrames}
	return c.writeNow(hopmux.Frame(hopmux.FrameServerInfo, info.Append(nil)), time.Now().Add(s.WriteTimeout))
}

// rawUpgrade answers GET /tunnel with Upgrade: RawTunnelUpgrade: 101,
// then the hijacked connection carries frames as they are.
func (s *Server) rawUpgrade(w http.ResponseWriter, r *http.Request) *peerConn {
	hj, ok := w.(http.Hijacker)
	if !ok {
		writeHTTPError(w, http.StatusNotImplemented, "not_supported", "this server cannot upgrade to a raw tunnel")
		return nil
	}
	c, brw, err := hj.Hijack()
	if err != nil {
		return nil
	}
	c.SetWriteDeadline(time.Now().Add(s.WriteTimeout))
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + RawTunnelUpgrade + "\r\n\r\n")
	if err := brw.Flush(); err != nil {
		c.Close()
		return nil
	}
	br := brw.Reader
	if br.Size() < 64<<10 {
		br = bufio.NewReaderSize(io.MultiReader(io.LimitReader(br, int64(br.Buffered())), c), 64<<10)
	}
	pc := &peerConn{s: s, kind: "tunnel", pending: map[uint64]*pending{}, sent: map[uint64]*pending{}}
	pc.c = newRawConn(c, br, s.SendQueue, s.WriteTimeout)
	pc.c.onWrite = s.countOut
	return pc
}

// readOneFrame reads a message holding one frame (handshake only).
func readOneFrame(ws *websocket.Conn, max int) (hopmux.FrameType, []byte, error) {
	mt, r, err := ws.NextReader()
	if err != nil {
		return 0, nil, err
	}
	if mt != websocket.BinaryMessage {
		return 0, nil, errors.New("tunnel: expected a binary message")
	}
	return hopmux.ReadFrame(r, max)
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
	strikes := 0
	for {
		r, err := pc.c.frames(s.IdleTimeout)
		if err != nil {
			return err
		}
		for {
			pc.c.extendRead(s.IdleTimeout)
			typ, n, err := hopmux.ReadFrameHeader(r, s.MaxFrameBytes)
			if err == io.EOF && !pc.c.endOfFrames() {
				break
			}
			if err != nil {
				return err
			}
			s.countIn(hopmux.FrameHeaderLen + n)
			// Hop frames pass through unparsed: the relay reads the routing
			// prefix, rewrites it, and passes the rest on from its read
			// buffer where it is all there (readPassBody), else from a
			// pooled buffer.
			switch typ {
			case hopmux.FrameHop:
				rt, rest, err := hopmux.ReadHopRoute(r, n)
				if err != nil {
					return fmt.Errorf("malformed Hop frame: %w", err)
				}
				body, err := readPassBody(r, rest)
				if err != nil {
					return err
				}
				p := &pending{srcKey: pc.srcKey, entry: "tunnel", origin: pc, originID: rt.Stream, hop: true}
				if s.forwardHop(p, rt.Peer, body, pc.peerID) {
					strikes++
					time.Sleep(min(time.Duration(strikes)*floodPause, maxFloodPause))
				} else {
					strikes = 0
				}
				continue
			case hopmux.FrameHopReply:
				var id [8]byte
				if n < len(id) {
					return fmt.Errorf("malformed HopReply frame of %d bytes", n)
				}
				if _, err := io.ReadFull(r, id[:]); err != nil {
					return hopmux.ErrShortFrame
				}
				body, err := readPassBody(r, n-len(id))
				if err != nil {
					return err
				}
				s.complete(pc, binary.BigEndian.Uint64(id[:]), result{isHop: true, hopBody: body})
				continue
			}
			if typ > hopmux.FrameHopReply {
				// A frame type this version does not know: skipped unread.
				if err := hopmux.Discard(r, n); err != nil {
					return err
				}
				continue
			}
			// A fresh buffer per frame: bodies are handed on by reference.
			p, err := readPayload(r, n)
			if err != nil {
				return err
			}
			switch typ {
			case hopmux.FrameRequest:
				q, err := hopmux.ParseTunnelRequest(p)
				if err != nil {
					return fmt.Errorf("malformed Request frame: %w", err)
				}
				p := &pending{srcKey: pc.srcKey, entry: "tunnel", origin: pc, originID: q.ID}
				if s.forward(p, q.Peer, q.Method, q.Path, q.Header, q.Body, pc.peerID) {
					strikes++
					time.Sleep(min(time.Duration(strikes)*floodPause, maxFloodPause))
				} else {
					strikes = 0
				}
			case hopmux.FrameResponse:
				a, err := hopmux.ParseTunnelResponse(p)
				if err != nil {
					return fmt.Errorf("malformed Response frame: %w", err)
				}
				s.complete(pc, a.ID, result{status: int(a.Status), header: a.Header, body: a.Body})
			case hopmux.FrameError:
				e, err := hopmux.ParseTunnelError(p)
				if err != nil {
					return fmt.Errorf("malformed Error frame: %w", err)
				}
				code := int(e.Code)
				if code < 400 || code > 599 {
					code = http.StatusBadGateway
				}
				s.complete(pc, e.ID, relayErr(code, "peer_error", "%s", e.Message))
			case hopmux.FrameResponseStart:
				a, err := hopmux.ParseTunnelResponse(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseStart frame: %w", err)
				}
				s.streamStart(pc, a)
			case hopmux.FrameResponseData:
				id, data, err := hopmux.ParseData(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseData frame: %w", err)
				}
				s.streamData(pc, id, data)
			case hopmux.FrameResponseEnd:
				id, err := hopmux.ParseID(p)
				if err != nil {
					return fmt.Errorf("malformed ResponseEnd frame: %w", err)
				}
				s.streamEnd(pc, id)
			case hopmux.FramePing:
				pc.c.send(outMsg{head: hopmux.Frame(hopmux.FramePong, p)})
			case hopmux.FrameCancel:
				if id, err := hopmux.ParseID(p); err == nil {
					s.cancelFrom(pc, id)
				}
			default:
				// Pong and unknown frame types: skipped.
			}
		}
	}
}
