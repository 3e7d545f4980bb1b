package wire

// Headers that carry a session's route ticket (docs/security.md).
const (
	// HeaderTicket carries, in unpadded base64url, a route ticket: from the
	// tracker to the head (a ticket.Ticket), and on POST /forward the pass
	// the hop frames carry in Binding.Ticket (ticket.Pass).
	HeaderTicket = "X-Meshnet-Ticket"
	// HeaderSessionKey is the per-hop session key (unpadded base64url) that
	// DELETE /sessions/{id} presents to free a ticketed session.
	HeaderSessionKey = "X-Meshnet-Session-Key"
	// HeaderSessionRelease is the ticket issuer's signature (unpadded
	// base64url, ticket.SignRelease) that lets DELETE /sessions/{id} free a
	// ticketed session without its key: how a tracker frees a failed
	// route's sessions (it signs tickets; the head makes the keys).
	HeaderSessionRelease = "X-Meshnet-Session-Release"
)
