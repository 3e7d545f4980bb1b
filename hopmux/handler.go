package hopmux

import (
	"context"
	"encoding/json"

	"meshgpu/wire"
)

// Handler runs the hops a Conn reads (node.Server implements it).
type Handler interface {
	// AcceptHop validates a hop's head and returns the Hop that takes its
	// payload, or Refuse(reply) to refuse it: the Conn then skips the
	// payload and sends the reply.
	AcceptHop(ctx context.Context, h *wire.HopHead) Hop
}

// Hop is one accepted hop. The Conn reads exactly h.PayloadLen() bytes
// into Payload, then calls Serve exactly once: ok when the payload is in,
// !ok when it failed to arrive (Serve then returns nil). It sends the reply
// Serve returns, then calls the reply's Release.
type Hop interface {
	Payload() []byte
	Serve(ctx context.Context, ok bool) *wire.HopReply
}

// Accept is the Hop whose payload goes into buf and which serve runs.
func Accept(buf []byte, serve func(ctx context.Context, ok bool) *wire.HopReply) Hop {
	return &accepted{buf: buf, serve: serve}
}

type accepted struct {
	buf   []byte
	serve func(ctx context.Context, ok bool) *wire.HopReply
}

func (a *accepted) Payload() []byte                                   { return a.buf }
func (a *accepted) Serve(ctx context.Context, ok bool) *wire.HopReply { return a.serve(ctx, ok) }

// Refuse is the Hop of a refused hop: its payload is skipped and rep sent.
func Refuse(rep *wire.HopReply) Hop { return refusal{rep} }

// refusal holds only a pointer, so it is stored in a Hop without allocating.
type refusal struct{ rep *wire.HopReply }

func (r refusal) Payload() []byte                            { return nil }
func (r refusal) Serve(context.Context, bool) *wire.HopReply { return r.rep }

// Refused is the reply of a Hop made by Refuse, else nil.
func Refused(h Hop) *wire.HopReply {
	if r, ok := h.(refusal); ok {
		return r.rep
	}
	return nil
}

// ErrorReply is an error HopReply with meshgpu's one error body.
func ErrorReply(code int, typ, msg string) *wire.HopReply {
	b, _ := json.Marshal(wire.ErrorBody{Error: &wire.Error{Message: msg, Type: typ}})
	return &wire.HopReply{Status: code, Kind: wire.ReplyError, Body: b}
}
