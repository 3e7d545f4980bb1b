package node

import (
	"encoding/json"
	"net/http"
)

// handleIdentity answers a tracker's identity challenge (identity.ProofPath):
// the node signs the nonce, the endpoint the tracker reached it at and the
// tracker's id, with the model and layers it serves, so a tracker routes to
// an endpoint only once it has answered as the registered peer id.
func (s *Server) handleIdentity(w http.ResponseWriter, r *http.Request) {
	if s.Identity == nil {
		writeError(w, &apiError{Status: http.StatusNotFound, Type: "not_found", Message: "this node has no identity key"})
		return
	}
	q := r.URL.Query()
	nonce := q.Get("nonce")
	if len(nonce) < 16 {
		writeError(w, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: "nonce must be at least 16 characters"})
		return
	}
	p, err := s.Identity.Prove(nonce, q.Get("endpoint"), q.Get("tracker"), s.ModelName, [2]int{s.cfg.First, s.cfg.Last})
	if err != nil {
		writeError(w, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(p)
}
