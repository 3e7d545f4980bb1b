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
)
