package daemon

import (
	"context"
	"crypto/ed25519"

	"meshgpu/identity"
)

// trackerKeys are the ticket keys of the mesh's trackers, as the trackers
// list of the node's last heartbeat answer (from its --tracker) names them.
func (n *Node) trackerKeys() []ed25519.PublicKey {
	var keys []ed25519.PublicKey
	for _, t := range n.trackc.Trackers() {
		if k, err := identity.ParsePublicHex(t.PublicKey); err == nil {
			keys = append(keys, k)
		}
	}
	return keys
}

func (n *Node) refreshTrackers(ctx context.Context) { n.trackc.RefreshTrackers(ctx) }
