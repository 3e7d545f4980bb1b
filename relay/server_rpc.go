package relay

import (
	"crypto/subtle"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/gorilla/websocket"
)

// /rpc/{peer_id}: ADR-0014's one WebSocket per request.

// absentPeerMessage bounds the /rpc message read for a peer that is not
// connected: a larger one closes the connection (1009) unread.
const absentPeerMessage = 64 << 10

func (s *Server) handleRPC(w http.ResponseWriter, r *http.Request) {
	if !s.enter() {
		writeHTTPError(w, http.StatusServiceUnavailable, "shutting_down", "relay is shutting down")
		return
	}
	defer s.wg.Done()
	target := r.PathValue("peer_id")
	if !validPeerID(target) {
		writeHTTPError(w, http.StatusBadRequest, "bad_request", "peer id must be 1-128 characters of [A-Za-z0-9._:-]")
		return
	}
	if s.JoinToken != "" && subtle.ConstantTimeCompare([]byte(r.Header.Get(JoinTokenHeader)), []byte(s.JoinToken)) != 1 {
		s.m.authFailures.Inc()
		writeHTTPError(w, http.StatusUnauthorized, "unauthorized", "join token missing or wrong ("+JoinTokenHeader+" header)")
		return
	}
	// The target is looked up before the message is read: a message to a
	// peer that is not here is read only as far as a small request goes,
	// enough to answer it (404 peer_not_connected, in the envelope), not
	// its megabytes.
	limit := s.maxEnvelope()
	s.mu.Lock()
	if s.peers[target] == nil {
		limit = absentPeerMessage
	}
	s.mu.Unlock()
	leave, ok := s.enterUnauth(w, r)
	if !ok {
		return
	}
	defer leave()
	ws, err := s.rpcUpgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		ws.Close()
		return
	}
	s.rpcConns[ws] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.rpcConns, ws)
		s.mu.Unlock()
		ws.Close()
	}()
	ws.SetReadLimit(limit)
	ws.SetReadDeadline(time.Now().Add(handshakeTimeout))
	_, rd, err := ws.NextReader()
	if err != nil {
		s.noteReadErr(err)
		return
	}
	msg, err := io.ReadAll(rd)
	if err != nil {
		s.noteReadErr(err)
		return
	}
	s.countIn(len(msg))
	e, perr := parseEnvelope(msg)
	msg = nil
	leave() // read: the in-flight limit takes over
	var res result
	reqID := ""
	if perr != nil {
		res = relayErr(http.StatusBadRequest, "bad_request", "%v", perr)
		s.m.requests.WithLabelValues("rpc", "bad_request").Inc()
	} else {
		reqID = e.RequestID
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		p := &pending{srcKey: "ip:" + host, entry: "rpc", ch: make(chan result, 1)}
		s.forward(p, target, e.Method, e.Path, e.Header, e.Body, "")
		res = <-p.ch // finish always runs: answer, timeout or disconnect
	}
	out := &envelope{RequestID: reqID, Status: res.status, Header: res.header, Body: res.body}
	if res.errCode != 0 {
		b, _ := json.Marshal(errorBody(res.errType, res.errMsg, target))
		out.Status = res.errCode
		out.Header = http.Header{"Content-Type": {"application/json"}, RelayErrorHeader: {res.errType}}
		out.Body = b
	}
	out.Text = textBody(out.Header, out.Body)
	ws.SetWriteDeadline(time.Now().Add(s.WriteTimeout))
	wr, err := ws.NextWriter(websocket.TextMessage)
	if err != nil {
		return
	}
	cw := countingWriter{w: wr}
	if writeEnvelope(&cw, out) == nil && wr.Close() == nil {
		s.countOut(cw.n)
		ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
	}
}
