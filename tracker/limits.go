package tracker

import "context"

// Limits bound what registrations can grow in a tracker: 300 flood
// registrations from ten addresses once made /metrics 19.5 MB, /api/mesh
// 39 MB and the tracker 264 MB, kept alive by heartbeats. The rate limits
// (admission.go) bound how fast; these bound how much. A source is an
// address as sourceKey sees it (an IPv6 /64). Zero fields take defaults.
type Limits struct {
	MaxNodes           int // live nodes (DefaultMaxNodes)
	MaxNodesPerSource  int // live nodes registered from one source (DefaultMaxNodesPerSource)
	MaxModels          int // distinct model names (DefaultMaxModels)
	MaxModelsPerSource int // distinct model names one source's nodes serve (DefaultMaxModelsPerSource)
	// MaxTrackerLayers bounds the layers of every model variant together
	// (the per-layer series and map entries the tracker keeps).
	MaxTrackerLayers int
	// MaxLayersPerSource bounds the layers of the model variants one
	// source's nodes serve (DefaultMaxLayersPerSource): model names are
	// capped per source, but one name has as many variants as fingerprints
	// anyone makes up, so without it one address filled MaxTrackerLayers
	// and every new model got 503.
	MaxLayersPerSource int
}

// Defaults of Limits, `meshgpu tracker --max-nodes` and the like.
const (
	DefaultMaxNodes           = 4096
	DefaultMaxNodesPerSource  = 16 // a machine or a NAT with a few GPUs each running a node
	DefaultMaxModels          = 64
	DefaultMaxModelsPerSource = 4
	DefaultMaxTrackerLayers   = 8192
	// DefaultMaxLayersPerSource lets one address serve the largest model
	// (MaxLayers) or a few real ones (a hundred layers or so each), and
	// leaves the tracker's layers to eight addresses at least.
	DefaultMaxLayersPerSource = MaxLayers
)

func (l Limits) withDefaults() Limits {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&l.MaxNodes, DefaultMaxNodes)
	def(&l.MaxNodesPerSource, DefaultMaxNodesPerSource)
	def(&l.MaxModels, DefaultMaxModels)
	def(&l.MaxModelsPerSource, DefaultMaxModelsPerSource)
	def(&l.MaxTrackerLayers, DefaultMaxTrackerLayers)
	def(&l.MaxLayersPerSource, DefaultMaxLayersPerSource)
	return l
}

// check refuses reg when storing it would pass a limit; nodes are the live
// records (reg's own previous one, if any, is replaced, so it does not
// count). Per-source limits are 429 (that source is over its share), the
// tracker's own 503 (full): a node retries both.
func (l Limits) check(nodes []NodeRecord, reg *Registration, source string) error {
	l = l.withDefaults()
	others, fromSource := 0, 0
	models, sourceModels := map[string]bool{}, map[string]bool{}
	shapes, sourceShapes := map[shapeKey]int{}, map[shapeKey]int{}
	layers, sourceLayers := 0, 0
	exists := false
	for i := range nodes {
		r := &nodes[i]
		if r.PeerID == reg.PeerID {
			exists = true
			continue
		}
		others++
		models[r.Model] = true
		if source != "" && r.Source == source {
			fromSource++
			sourceModels[r.Model] = true
			sourceLayers += grow(sourceShapes, keyOf(r), r.NumLayers)
		}
		layers += grow(shapes, keyOf(r), r.NumLayers)
	}
	if !exists && others >= l.MaxNodes {
		return errf(503, "service_unavailable", "this tracker holds its maximum of %d live nodes (--max-nodes); retry later", l.MaxNodes)
	}
	if source != "" && !exists && fromSource >= l.MaxNodesPerSource {
		return errf(429, "rate_limit_error", "%s has %d live nodes registered, the most one address may (--max-nodes-per-source)", source, fromSource)
	}
	if source != "" && !sourceModels[reg.Model] && len(sourceModels) >= l.MaxModelsPerSource {
		return errf(429, "rate_limit_error", "%s's nodes serve %d models, the most one address may (--max-models-per-source)", source, len(sourceModels))
	}
	if !models[reg.Model] && len(models) >= l.MaxModels {
		return errf(503, "service_unavailable", "this tracker serves its maximum of %d models (--max-models); model %s is not admitted", l.MaxModels, reg.Model)
	}
	k := shapeKey{reg.Model, reg.Variant.Fingerprint}
	if add := reg.NumLayers - sourceShapes[k]; source != "" && add > 0 && sourceLayers+add > l.MaxLayersPerSource {
		return errf(429, "rate_limit_error", "%s's nodes serve model variants of %d layers in all, the most one address may (--max-layers-per-source); %s with %d layers is not admitted",
			source, sourceLayers, reg.Model, reg.NumLayers)
	}
	if add := reg.NumLayers - shapes[k]; add > 0 && layers+add > l.MaxTrackerLayers {
		return errf(503, "service_unavailable", "this tracker holds its maximum of %d layers over all models (--max-tracker-layers); %s with %d layers is not admitted",
			l.MaxTrackerLayers, reg.Model, reg.NumLayers)
	}
	return nil
}

// grow records n layers for variant k in shapes and returns how many more
// layers that adds (a variant counts with its largest layer count).
func grow(shapes map[shapeKey]int, k shapeKey, n int) int {
	add := max(n-shapes[k], 0)
	shapes[k] += add
	return add
}

type sourceCtxKey struct{}

// withSource records the request's source address for the registry.
func withSource(ctx context.Context, remoteAddr string) context.Context {
	return context.WithValue(ctx, sourceCtxKey{}, sourceKey(remoteAddr))
}

func sourceFrom(ctx context.Context) string {
	s, _ := ctx.Value(sourceCtxKey{}).(string)
	return s
}
