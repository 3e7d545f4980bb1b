// Package wire is meshgpu's hop protocol as types: the hop head and reply,
// the per-session binding, routes, sampling parameters, the token reply,
// tickets' binding, the dtypes and every limit a receiver checks. It
// imports no other meshgpu package and no cgo, so every package (node,
// relay, tracker, bench, engine) uses these definitions and none other.
// Their binary encoding, the frames of hop connections and of the relay
// tunnel (layouts, codec and multiplexer), is package hopmux
// (hopmux/doc.go); the OpenAI API a head and the tracker serve is package
// openai, which builds on the error bodies and sampling limits here.
// Prose: docs/protocol.md (hops) and docs/relay.md (the relay).
//
// # Versions
//
// ProtocolVersion (2) is the hop protocol: hop frames and session
// bindings. A node that speaks it answers GET /hop with "Upgrade:
// meshgpu-hop/2"; older nodes answer 404 and are sent POST /forward with
// X-Meshnet-* headers (version 1, still served by every node). The relay
// tunnel keeps its own TunnelVersion (1, hopmux): hop frames were added
// to it as new frame types, announced by feature bits, without a version
// bump.
package wire
