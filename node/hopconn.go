package node

import (
	"context"

	"meshgpu/wire"
)

// hopPeers holds this node's hop connections to its peers.
type hopPeers struct{}

func (p *hopPeers) do(ctx context.Context, endpoint string, h *wire.HopHead, payload []byte, into wire.ReplyBuffer) (*wire.HopReply, error) {
	return nil, wire.ErrHopFramesUnsupported
}
