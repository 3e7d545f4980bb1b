package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
)

// A GGUF fetched from the hub by byte range (model/hub) is a file of full
// size whose bytes outside the node's tensors are holes, read as zeros. The
// sidecar beside it records which bytes are really there; the loader reads
// it so that a range whose tensors were never fetched is refused instead of
// running on zeros.

// GGUFSidecarSuffix names the sidecar: FILE.gguf + this.
const GGUFSidecarSuffix = ".ranges.json"

// ByteRange is the byte range [Start, End) of a file.
type ByteRange struct {
	Start int64 `json:"start"`
	End   int64 `json:"end"`
}

// GGUFSidecar is which bytes of a partly fetched GGUF file are on disk.
type GGUFSidecar struct {
	Size     int64       `json:"size"`
	Digest   string      `json:"digest"`   // the listing's checksum of the whole file
	Have     []ByteRange `json:"have"`     // complete byte ranges, sorted and merged
	Verified bool        `json:"verified"` // every byte is there and matched Digest
}

// Covers reports whether [start, end) lies within one range on disk (Have
// is sorted and merged, so a covered range lies within one).
func (s *GGUFSidecar) Covers(start, end int64) bool {
	for _, r := range s.Have {
		if r.Start <= start && end <= r.End {
			return true
		}
	}
	return start >= end
}

// readGGUFSidecar reads path's sidecar; nil when there is none or the file
// is complete and verified.
func readGGUFSidecar(path string, size int64) (*GGUFSidecar, error) {
	data, err := os.ReadFile(path + GGUFSidecarSuffix)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var s GGUFSidecar
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("%s%s: %v", path, GGUFSidecarSuffix, err)
	}
	if s.Verified {
		return nil, nil
	}
	if s.Size != size {
		return nil, fmt.Errorf("%s%s describes a file of %d bytes, but the file has %d", path, GGUFSidecarSuffix, s.Size, size)
	}
	return &s, nil
}
