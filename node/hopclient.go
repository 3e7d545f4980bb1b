package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"meshgpu/native"
	"meshgpu/wire"
)

// hopCall is what a sender puts in the hop headers besides the route.
type hopCall struct {
	session         string
	nTokens, hidden int
	dtype           native.DType
	pos             int
	sampling        string // raw X-Meshnet-Sampling, passed along unchanged
}

// hopResult is a downstream 200: activations or a token JSON.
type hopResult struct {
	header http.Header
	body   []byte
}

var passHeaders = []string{"Content-Type", wire.HeaderShape, wire.HeaderDType, wire.HeaderEndLayer}

func (r *hopResult) writeTo(w http.ResponseWriter) {
	for _, k := range passHeaders {
		if v := r.header.Get(k); v != "" {
			w.Header().Set(k, v)
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(r.body)))
	w.WriteHeader(http.StatusOK)
	w.Write(r.body)
}

// token reads a last-hop decode answer.
func (r *hopResult) token(hop string) (*wire.TokenReply, *apiError) {
	if !strings.HasPrefix(r.header.Get("Content-Type"), "application/json") {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "route_incomplete", Hop: hop,
			Message: fmt.Sprintf("the route ended at layer %s without reaching the model's last layer", r.header.Get(wire.HeaderEndLayer))}
	}
	var t wire.TokenReply
	if err := json.Unmarshal(r.body, &t); err != nil {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop, Message: "token JSON: " + err.Error()}
	}
	return &t, nil
}

// sendHop sends body to hop with rest as its route, retrying once on a
// transport failure, a timeout or a 500/503. deadline bounds both attempts;
// zero gives each attempt its own HopTimeout (the head's per-token hop). The
// retry uses the same position, which the receiver treats as a redo, so no
// token is skipped or duplicated.
func (s *Server) sendHop(ctx context.Context, hop wire.Hop, rest []wire.Hop, c hopCall, body []byte, deadline time.Time) (*hopResult, *apiError) {
	var routeJSON string
	if len(rest) > 0 {
		b, err := json.Marshal(rest)
		if err != nil {
			return nil, asAPIError(err)
		}
		routeJSON = string(b)
	}
	var last *apiError
	for attempt := 1; attempt <= 2; attempt++ {
		d := deadline
		if d.IsZero() {
			d = time.Now().Add(s.HopTimeout)
		}
		if !time.Now().Before(d) {
			break
		}
		useRelay := hop.RelayAddr != "" && s.Relay != nil && (attempt == 1 || hop.Endpoint == "")
		if !useRelay && hop.Endpoint == "" {
			return nil, &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(),
				Message: "hop has no endpoint and this node has no relay client"}
		}
		res, ae := s.hopAttempt(ctx, hop, routeJSON, c, body, d, useRelay)
		if ae == nil {
			return res, nil
		}
		last = ae
		// Retry our own transport failures and a downstream 500/503. The
		// head (no fixed deadline) also retries a 502/504 reported from
		// deeper in the chain, whose nodes had no time left to retry.
		retry := ae.transport || ae.Status == 500 || ae.Status == 503 ||
			(deadline.IsZero() && (ae.Status == 502 || ae.Status == 504))
		if ctx.Err() != nil || !retry {
			break
		}
		if attempt == 1 {
			s.Logger.Warn("hop failed, retrying once", "hop", hop.Name(), "session", c.session, "position", c.pos, "error", ae.Message)
		}
	}
	if last == nil {
		last = &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Hop: hop.Name(), Message: "no time left for the hop"}
	}
	return nil, last
}

func (s *Server) hopAttempt(ctx context.Context, hop wire.Hop, routeJSON string, c hopCall, body []byte, d time.Time, useRelay bool) (*hopResult, *apiError) {
	actx, cancel := context.WithDeadline(ctx, d)
	defer cancel()
	base := strings.TrimRight(hop.Endpoint, "/")
	if base == "" {
		base = relayOnlyBase(hop) // the relay carries only the path
	}
	// body is a lent host buffer read in place (no copy); the fence stops
	// the transport reading it once this attempt is over.
	fence := &bodyFence{b: body}
	defer fence.fence()
	req, err := http.NewRequestWithContext(actx, http.MethodPost, base+"/forward", fence.reader())
	if err != nil {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(), Message: err.Error()}
	}
	req.ContentLength = int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return fence.reader(), nil }
	h := req.Header
	h.Set("Content-Type", "application/octet-stream")
	h.Set(wire.HeaderSession, c.session)
	h.Set(wire.HeaderShape, strconv.Itoa(c.nTokens)+","+strconv.Itoa(c.hidden))
	h.Set(wire.HeaderDType, c.dtype.String())
	h.Set(wire.HeaderStartLayer, strconv.Itoa(hop.StartLayer))
	h.Set(wire.HeaderEndLayer, strconv.Itoa(hop.EndLayer))
	h.Set(wire.HeaderPosition, strconv.Itoa(c.pos))
	h.Set(wire.HeaderHopDeadline, strconv.FormatInt(d.UnixMilli(), 10))
	if routeJSON != "" {
		h.Set(wire.HeaderRoute, routeJSON)
	}
	if c.sampling != "" {
		h.Set(wire.HeaderSampling, c.sampling)
	}
	start := time.Now()
	var resp *http.Response
	if useRelay {
		resp, err = s.Relay.Do(actx, hop.RelayAddr, req)
	} else {
		resp, err = s.client.Do(req)
	}
	if err != nil {
		return nil, s.transportError(ctx, actx, hop, err, time.Since(start))
	}
	defer resp.Body.Close()
	limit := int64(c.nTokens)*int64(c.hidden)*4 + 1<<20
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, s.transportError(ctx, actx, hop, err, time.Since(start))
	}
	if int64(len(data)) > limit {
		return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(),
			Message: fmt.Sprintf("hop answered more than %d bytes", limit)}
	}
	if resp.StatusCode != http.StatusOK {
		if resp.StatusCode < 400 { // a redirect or an empty 2xx is no hop answer
			return nil, &apiError{Status: http.StatusBadGateway, Type: "bad_hop_response", Hop: hop.Name(),
				Message: fmt.Sprintf("hop answered %s; want 200 or an error", resp.Status)}
		}
		return nil, decodeErrorBody(resp.StatusCode, data, hop.Name())
	}
	return &hopResult{header: resp.Header, body: data}, nil
}

func (s *Server) transportError(ctx, actx context.Context, hop wire.Hop, err error, took time.Duration) *apiError {
	switch {
	case ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded):
		return &apiError{Status: 499, Type: "canceled", Hop: hop.Name(), Message: "request canceled by the client"}
	case errors.Is(actx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Hop: hop.Name(), transport: true,
			Message: fmt.Sprintf("hop to %s did not answer within %v", hop.Name(), took.Round(time.Millisecond))}
	}
	return &apiError{Status: http.StatusBadGateway, Type: "hop_unreachable", Hop: hop.Name(), transport: true,
		Message: fmt.Sprintf("hop to %s failed: %v", hop.Name(), err)}
}

// deleteSessions frees the session on every hop of the route (best effort,
// in parallel, bounded by a short timeout); ctx should outlive the request.
func (s *Server) deleteSessions(ctx context.Context, route []wire.Hop, id string) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	done := make(chan struct{}, len(route))
	for _, hop := range route {
		go func() {
			defer func() { done <- struct{}{} }()
			base := strings.TrimRight(hop.Endpoint, "/")
			useRelay := hop.RelayAddr != "" && s.Relay != nil
			if base == "" {
				if !useRelay {
					return
				}
				base = relayOnlyBase(hop)
			}
			req, err := http.NewRequestWithContext(ctx, http.MethodDelete, base+"/sessions/"+id, nil)
			if err != nil {
				return
			}
			var resp *http.Response
			if useRelay {
				resp, err = s.Relay.Do(ctx, hop.RelayAddr, req)
			} else {
				resp, err = s.client.Do(req)
			}
			if err != nil {
				s.Logger.Debug("freeing session on hop failed", "hop", hop.Name(), "session", id, "error", err)
				return
			}
			io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
		}()
	}
	for range route {
		<-done
	}
}

// relayOnlyBase is a placeholder base URL for a hop reached only through a
// relay; the relay forwards the request's path and headers.
func relayOnlyBase(hop wire.Hop) string {
	if hop.PeerID != "" && wire.ValidSessionID(hop.PeerID) {
		return "http://" + hop.PeerID
	}
	return "http://relay.invalid"
}
