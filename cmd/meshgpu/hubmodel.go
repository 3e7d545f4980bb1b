package main

import (
	"context"
	"fmt"

	"meshgpu/model/hub"
)

// modelDir turns a --model value into a local path: a directory or a .gguf
// file as is; a Hugging Face repository id ("org/name") downloaded into the
// cache ($HF_ENDPOINT, $HF_TOKEN, $MESHGPU_CACHE_DIR), fetching of a sharded
// checkpoint only the shards that hold layers ("a-b"; "" for all); a GGUF
// on the hub ("org/name:Q4_K_M" or "org/name/file.gguf") downloaded the
// same way, fetching only the byte ranges of those layers' tensors, and
// returned as the local .gguf file's path (a split file's first part).
func modelDir(ctx context.Context, arg, layers string) (string, error) {
	prog := newProgress("downloading " + arg)
	defer prog.Finish()
	dir, err := hub.Resolve(ctx, arg, hub.Options{Layers: layers,
		Progress: func(_ string, done, total int64) { prog.Update(done, total) }})
	if err != nil {
		return "", fmt.Errorf("--model: %w", err)
	}
	return dir, nil
}
