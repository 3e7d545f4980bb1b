// Package tracker is the mesh's control plane: signed node registration and
// heartbeats, the availability map, layer assignment, route choice
// (planning lives in tracker/route) and an OpenAI-compatible chat proxy
// that fails over mid-generation. docs/tracker.md describes the protocol.
package tracker

import (
	"time"

	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// Registration is the body of POST /register (kind "register").
type Registration struct {
	Auth
	Endpoint  string `json:"endpoint,omitempty"`   // http://host:port of the hop server; empty when relay-only
	RelayAddr string `json:"relay_addr,omitempty"` // ws(s)://relay/rpc/{peer_id}
	Model     string `json:"model"`
	// Variant is the weights the node holds (wire.Variant): it is routed
	// and audited only with nodes of the same variant. Absent (an older
	// node): the empty variant.
	Variant      wire.Variant `json:"variant,omitzero"`
	NumLayers    int          `json:"num_layers"`
	Layers       [2]int       `json:"layers"` // first, last (inclusive)
	Backend      string       `json:"backend"`
	Hidden       int          `json:"hidden,omitempty"`
	MemoryBudget int64        `json:"memory_budget"`
	FreeMemory   int64        `json:"free_memory"`
	Footprint
	// MsPerLayer is the compute time of one layer for one decode step,
	// measured by the node at start-up.
	MsPerLayer float64 `json:"ms_per_layer"`
	// JoinToken must match the tracker's --join-token when it has one.
	JoinToken string `json:"join_token,omitempty"`
	// RelayDown says the node's connection to its relay is down now (a
	// relay-only node is then unreachable; heartbeats update it).
	RelayDown bool `json:"relay_down,omitempty"`
	Replies
}

// Replies is what a node says at registration about direct replies
// (docs/protocol.md, Direct replies). The tracker's route ticket names the
// head's registered endpoint and relay, which makes it version 3, only
// when every node on the route reads that version and the head asked for
// direct replies; otherwise it is version 1 or 2, which older nodes read.
type Replies struct {
	// TicketVersion is the newest route-ticket version the node reads
	// (ticket.Version); absent (an older node): 2 at most.
	TicketVersion int `json:"ticket_version,omitempty"`
	// DirectReplies: as the head of a route, the node wants the tail to
	// send each answer straight to it (--direct-replies).
	DirectReplies bool `json:"direct_replies,omitempty"`
}

// Footprint is the model's memory cost on a node, in bytes.
type Footprint struct {
	BytesPerLayer     int64 `json:"bytes_per_layer"` // the largest layer's, when they differ
	KVReservePerLayer int64 `json:"kv_reserve_per_layer"`
	EmbedBytes        int64 `json:"embed_bytes"`
	HeadBytes         int64 `json:"head_bytes"`
	// LayerBytes is each layer's weights as stored in the node's file (a
	// quantized file's layers differ); assignment uses it instead of
	// BytesPerLayer when it has one entry per layer.
	LayerBytes []int64 `json:"layer_bytes,omitempty"`
}

// NodeStats is what a heartbeat reports.
type NodeStats struct {
	RPM1         float64 `json:"rpm1"`
	RPM5         float64 `json:"rpm5"`
	TokensPerSec float64 `json:"tokens_per_sec"`
	HopP50Ms     float64 `json:"hop_p50_ms"`
	HopP99Ms     float64 `json:"hop_p99_ms"`
	Sessions     int     `json:"sessions"`
	// Load at the heartbeat: OpenAI requests generating and queued on a
	// head, hops being served. Routing adds it to the RPM's load term.
	Running      int `json:"running,omitempty"`
	Queued       int `json:"queued,omitempty"`
	HopsInFlight int `json:"hops_in_flight,omitempty"`
}

// Heartbeat is the body of POST /heartbeat (kind "heartbeat").
type Heartbeat struct {
	Auth
	FreeMemory int64     `json:"free_memory"`
	Stats      NodeStats `json:"stats"`
	// MsPerLayer, when > 0, replaces the registered compute time per layer.
	MsPerLayer float64 `json:"ms_per_layer,omitempty"`
	// RelayDown says the node's relay connection is down: a node with no
	// endpoint leaves routes at once, and comes back (unbanned) with the
	// heartbeat that says it is up. A node sends one as soon as the
	// connection changes, not only every interval.
	RelayDown bool `json:"relay_down,omitempty"`
}

// Deregistration is the body of POST /deregister (kind "deregister"): a
// node shutting down leaves routes at once instead of at the heartbeat
// timeout.
type Deregistration struct {
	Auth
}

// HeartbeatResponse may order the node to move to another layer range; the
// node then loads it and registers again with the new range.
type HeartbeatResponse struct {
	Move *Range `json:"move,omitempty"`
	// Trackers lists the mesh's trackers (ids, public keys, URLs): a node
	// moves to another when its tracker stops answering.
	Trackers []TrackerInfo `json:"trackers,omitempty"`
	// Routable says whether the tracker routes requests through the node
	// now (Registry.Routable), with the reason when not; absent from older
	// trackers. A head's /ready reports it.
	Routable    *bool  `json:"routable,omitempty"`
	NotRoutable string `json:"not_routable,omitempty"`
}

// Range is an inclusive layer range.
type Range struct {
	First int `json:"first"`
	Last  int `json:"last"`
}

// AssignRequest is the body of POST /assign (kind "assign"): a node that
// has not loaded anything yet asks which layers to load.
type AssignRequest struct {
	Auth
	Model string `json:"model"`
	// Variant is the weights the node will load: the range fills the
	// coverage of that variant.
	Variant      wire.Variant `json:"variant,omitzero"`
	NumLayers    int          `json:"num_layers"`
	MemoryBudget int64        `json:"memory_budget"`
	Footprint
	MsPerLayer float64 `json:"ms_per_layer"`
	JoinToken  string  `json:"join_token,omitempty"`
}

// AssignResponse is the range to load and its score.
type AssignResponse struct {
	route.Assignment
}

// NodeRecord is the tracker's state for one node.
type NodeRecord struct {
	PeerID       string       `json:"peer_id"`
	PublicKey    string       `json:"public_key"`
	Endpoint     string       `json:"endpoint,omitempty"`
	RelayAddr    string       `json:"relay_addr,omitempty"`
	Model        string       `json:"model"`
	Variant      wire.Variant `json:"variant,omitzero"`
	NumLayers    int          `json:"num_layers"`
	Layers       [2]int       `json:"layers"`
	Backend      string       `json:"backend"`
	Hidden       int          `json:"hidden,omitempty"`
	MemoryBudget int64        `json:"memory_budget"`
	FreeMemory   int64        `json:"free_memory"`
	Footprint                 // bytes per layer, KV reserve, embed and head bytes
	MsPerLayer   float64      `json:"ms_per_layer"`
	Stats        NodeStats    `json:"stats"`
	// Verified says how the tracker checked that the node answers at its
	// addresses (VerifiedEndpoint, VerifiedRelay, VerifiedByRelay; "" when
	// the tracker does not check).
	Verified     string    `json:"verified,omitempty"`
	RegisteredAt time.Time `json:"registered_at"`
	LastSeen     time.Time `json:"last_heartbeat"`
	// LastTimestamp is the newest signed timestamp accepted from the node;
	// older or equal ones are replays.
	LastTimestamp int64 `json:"-"`
	// RelayDown: the node's last message said its relay connection is down.
	RelayDown bool `json:"relay_down,omitempty"`
	Replies        // as registered
	// RelayDownSince is when this tracker first heard of the current relay
	// outage (zero while the relay is up).
	RelayDownSince time.Time `json:"-"`
	// Move is a pending order to load another range, given at MoveAt.
	Move   *Range    `json:"move,omitempty"`
	MoveAt time.Time `json:"-"`
	// Revision is the store's version of the record, for conditional
	// writes (Store.Put).
	Revision int64 `json:"-"`
	// Source is the address the registration came from (sourceKey: an
	// IPv6 /64), which the per-source caps count; "" when registered
	// without one (embedding).
	Source string `json:"source,omitempty"`
}

// routeNode is the record as planning sees it.
func (r NodeRecord) routeNode() route.Node {
	relayAddr := r.RelayAddr
	if r.RelayDown {
		relayAddr = "" // a node with an endpoint is reached directly meanwhile
	}
	return route.Node{
		PeerID: r.PeerID, Endpoint: r.Endpoint, RelayAddr: relayAddr,
		First: r.Layers[0], Last: r.Layers[1], MsPerLayer: r.MsPerLayer, RPM1: r.Stats.RPM1,
		InFlight: float64(r.Stats.Running + r.Stats.Queued + r.Stats.HopsInFlight), Variant: r.Variant, NumLayers: r.NumLayers,
	}
}

// readsHeadAddress: the node reads route tickets that name the head's
// address (version 3).
func (r Replies) readsHeadAddress() bool { return r.TicketVersion >= ticketVersionHeadAddress }

// ticketVersionHeadAddress is the first route-ticket version that names
// the head's address (ticket.Ticket.HeadEndpoint).
const ticketVersionHeadAddress = 3
