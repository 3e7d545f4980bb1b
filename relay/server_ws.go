package relay

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/identity"
)

// /ws: ADR-0010's persistent JSON node connection.

type wsHello struct {
	Type      string `json:"type"`
	Nonce     string `json:"nonce,omitempty"`
	PeerID    string `json:"peer_id,omitempty"`
	PublicKey string `json:"public_key,omitempty"`
	Signature string `json:"signature,omitempty"`
	JoinToken string `json:"join_token,omitempty"`
	Message   string `json:"message,omitempty"`
	Version   int    `json:"version,omitempty"`
	MaxBytes  int64  `json:"max_message_bytes,omitempty"`
}

func (s *Server) handleWS(w http.ResponseWriter, r *http.Request) {
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
	ws, err := s.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	// The registration is read before the peer proved its key: a hello's
	// size, not an envelope's.
	ws.SetReadLimit(hopmux.MaxTunnelHello)
	pc := s.newPeerConn(ws, "ws", websocket.TextMessage)
	if !s.track(pc) {
		ws.Close()
		return
	}
	cause := s.wsHandshake(pc)
	if cause == nil {
		leave()
		ws.SetReadLimit(s.maxEnvelope())
		s.wg.Add(1)
		go func() { defer s.wg.Done(); pc.c.writeLoop() }()
		pc.accepts = true
		s.register(pc)
		cause = s.wsReadLoop(pc)
	}
	if c := pc.c.cause(); c != nil {
		cause = c
	}
	s.noteReadErr(cause)
	s.untrack(pc, cause)
}

func (s *Server) wsHandshake(pc *peerConn) error {
	ws := pc.c.ws
	nonce := newNonce()
	ws.SetWriteDeadline(time.Now().Add(s.WriteTimeout))
	if err := ws.WriteJSON(wsHello{Type: "challenge", Nonce: nonce, Version: 1}); err != nil {
		return err
	}
	ws.SetReadDeadline(time.Now().Add(handshakeTimeout))
	_, msg, err := ws.ReadMessage()
	if err != nil {
		return err
	}
	refuse := func(msg string) error {
		ws.WriteJSON(wsHello{Type: "error", Message: msg})
		return errors.New(msg)
	}
	var reg wsHello
	if err := json.Unmarshal(msg, &reg); err != nil || reg.Type != "register" {
		return refuse(`expected {"type":"register",...}`)
	}
	pub, err := identity.ParsePublicHex(reg.PublicKey)
	if err != nil {
		s.m.authFailures.Inc()
		return refuse("registration refused: " + err.Error())
	}
	sig, err := hex.DecodeString(reg.Signature)
	if err != nil {
		s.m.authFailures.Inc()
		return refuse("registration refused: signature must be hex")
	}
	if err := s.authenticate(reg.PeerID, pub, sig, nonce, reg.JoinToken); err != nil {
		s.m.authFailures.Inc()
		s.log.Warn("ws registration refused", "peer_id", reg.PeerID, "remote", ws.RemoteAddr().String(), "err", err)
		return refuse(err.Error())
	}
	pc.peerID = reg.PeerID
	return ws.WriteJSON(wsHello{Type: "registered", PeerID: reg.PeerID, MaxBytes: s.maxEnvelope()})
}

func (s *Server) wsReadLoop(pc *peerConn) error {
	ws := pc.c.ws
	var buf bytes.Buffer // reused: parseEnvelope copies out what it keeps
	for {
		ws.SetReadDeadline(time.Now().Add(s.IdleTimeout))
		_, r, err := ws.NextReader()
		if err != nil {
			return err
		}
		buf.Reset()
		if _, err := buf.ReadFrom(r); err != nil {
			return err
		}
		s.countIn(buf.Len())
		e, err := parseEnvelope(buf.Bytes())
		if err != nil {
			return fmt.Errorf("malformed message from node: %w", err)
		}
		if e.Type != typeHTTPResponse {
			continue // other message types (pings, future ones) are ignored
		}
		id, err := strconv.ParseUint(e.RequestID, 16, 64)
		if err != nil {
			s.m.unknown.Inc()
			continue
		}
		res := result{status: e.Status, header: e.Header, body: e.Body}
		if e.Status == 0 {
			res = relayErr(http.StatusBadGateway, "peer_error", "node answered without a status")
		}
		s.complete(pc, id, res)
	}
}
