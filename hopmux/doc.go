// Package hopmux is the hop frame package: the binary frames of hop
// connections and of the relay tunnel (their layouts below, their codec
// in frame.go and hopframe.go) and the multiplexer that runs hops over one
// stream of them (Conn). A Conn serves the Hop frames it reads to a
// Handler and writes their replies, and it sends hops and hands each
// reply to the hop waiting for it. A node's direct hop connections (GET
// /hop over TCP or TLS, a direct path's QUIC stream) and its end of a
// relay tunnel all run on one Conn each; the relay server only forwards
// hop frames, rewriting their stream ids (ReadHopRoute), and never parses
// their heads. The types the frames carry (wire.HopHead, wire.HopReply,
// wire.Binding) and their limits are package wire's.
//
// # Frames
//
// Every frame, on a direct hop connection (after the HTTP upgrade), in a
// relay tunnel WebSocket message (one or more whole frames per message)
// and on the relay's raw upgraded tunnel, is, like tailscale's DERP:
//
//	type u8 | length u32 | payload [length]
//
// Integers are big-endian; s8 and s16 are strings with a u8 or u16 length
// prefix; b16 and b32 are byte strings with a u16 or u32 length. A payload
// longer than the receiver's maximum (DefaultMaxFrame, 16 MiB, unless the
// other end announced less) closes the connection before anything is
// allocated for it. Frame types a reader does not know are skipped (their
// payload is discarded unread), so types can be added without a version
// bump; changing a layout bumps the version.
//
// Relay tunnel frames (relay <-> node):
//
//	0x01 ServerChallenge  "MGTN" | version u16 | nonce [32]
//	0x02 ClientHello      version u16 | flags u8 | peer id s8 | public key [32] | signature [64] | join token s16
//	0x03 ServerInfo       version u16 | max frame u32 | max in-flight per peer u32 | ping interval ms u32 | features u32
//	0x04 Request          request id u64 | peer id s8 | method s8 | path s16 | header block | body (rest)
//	0x05 Response         request id u64 | status u16 | header block | body (rest)
//	0x06 Error            request id u64 | code u16 | message (rest, UTF-8)
//	0x07 Ping             data [8]
//	0x08 Pong             data [8] (Ping's, echoed)
//	0x09 Cancel           request id u64
//	0x0a ResponseStart    request id u64 | status u16 | header block | body (rest)
//	0x0b ResponseData     request id u64 | body (rest)
//	0x0c ResponseEnd      request id u64
//
// The header block is count u16 | count x (name s16 | value s16). ServerInfo's
// features (absent from old relays, read as 0) has FeatureHopFrames when the
// relay forwards the hop frames below; ClientHello's flags has
// FlagAcceptsRequests (serve requests sent to this peer id) and
// FlagHopFrames (serve Hop frames).
//
// Hop frames (direct hop connections and the relay tunnel):
//
//	0x0d Hop       stream id u64 | peer id s8 | head b32 | payload (rest)
//	0x0e HopReply  stream id u64 | status u16 | kind u8 | body (rest)
//
// A Hop carries one token step's activations. Stream ids are chosen by the
// sender and unique among its streams in flight on that connection; the
// HopReply carries the same id. Sent to the relay, peer id names the
// target; sent by the relay it names the source (the relay rewrites the id
// and the peer id and nothing else; the head and payload pass unread). On
// a direct connection the peer id is empty. The head is:
//
//	flags u8 | session s8 | position u32 | n_tokens u32 | hidden u32 |
//	dtype u8 | step u32 | deadline unix ms u64 | token count u16 |
//	tokens [token count] i32 | seq u32 | after u32 (when flags has
//	HopPassOrder) | tree [n_tokens] u8 (when flags has HopTree) |
//	keep count u8 | keep [count] u8 (when flags has HopKeep) |
//	binding b16 (when flags has HopBound)
//
// payload is n_tokens x hidden values of dtype (wire.DTypeBF16 1, wire.DTypeF32 2),
// little-endian, row-major: exactly that many bytes. tokens (the ids at
// this hop's positions) are sent only when the sampling needs the history,
// and always, one per row, on a verify hop (flags has HopVerify: the last
// accepted token, then the drafts; wire/speculate.go), which has at most
// wire.MaxVerifyRows rows. A verify hop's rows may be a token tree (HopTree:
// each row's parent + 1, 0 for row 0, the root), and a session's next hop
// names the accepted branch's cache slots (HopKeep: offsets from position
// - count), which every node moves to position - count.. first (wire/tree.go).
//
// The binding (wire.Binding) is what stays fixed for a session: it rides on
// the first hop of a session to a peer, and again after a failover or when
// the peer answers 428 binding_required:
//
//	version u8 | start layer u16 | end layer u16 | route b16 (JSON list of Hop) |
//	sampling b16 (JSON SamplingParams) | ticket b16
//
// The ticket is opaque here: a signed route ticket (package ticket), which
// a node that requires tickets checks before it runs the hop
// (node/tickets.go).
//
// A HopReply's kind says what its body is:
//
//	1 activations  end layer u16 | n_tokens u32 | hidden u32 | dtype u8 | payload (rest)
//	2 token        token i32 | logprob f32 bits u32 [| model logprob f32 bits u32 |
//	               n u8 | n x (id i32 | logprob f32 bits u32)]
//	3 error        {"error":{"message","type","hop"}} (rest, JSON, as POST /forward answers)
//	4 tokens       count u16 | count x (token i32 | logprob f32 bits u32), a verify hop's
//	               accepted drafts and then the sampled token (1 <= count <= rows)
//
// The bracketed part of a token reply is there only when the sampling
// parameters ask for logprobs (wire.TokenLogprobs: the chosen token's model
// logprob and its n <= wire.MaxTopLogprobs alternatives).
//
// with status 200 for kinds 1, 2 and 4 and the HTTP status of POST /forward for
// errors. Cancel (0x09) with a stream id ends a hop the sender no longer
// waits for; Ping and Pong keep a quiet connection alive.
//
// # Limits
//
// A receiver checks every field against wire's limits (MaxHopHead,
// MaxBindingBytes, MaxRouteBytes, MaxSessionIDLen, MaxHopTokens, MaxHidden,
// MaxTicketBytes) before it allocates for it. A malformed frame closes that
// connection with an error; a well-formed hop with bad values (a layer
// outside the node's range, a byte count that disagrees with the shape)
// gets an error HopReply and the connection stays.
package hopmux
