package wire

import (
	"fmt"
	"strconv"
	"strings"
)

// Speculative decoding (docs/protocol.md, "Verify hops"): the head drafts
// k tokens, and one verify hop carries k+1 rows through the whole route:
// the last accepted token and the k drafts. The node with the last layer
// computes logits for every row, accepts the longest prefix of drafts its
// own sampler agrees with and answers the accepted tokens plus one (the
// token sampled where the first draft failed, or after the last). Every
// node rolls its KV cache back to the accepted length when the session's
// next hop arrives at that position (a hop below the cache's length
// truncates it first).

// SpeculateMode selects the drafts a head proposes.
type SpeculateMode string

// Speculation modes: off (one token per hop), ngram (prompt-lookup
// decoding: the continuation of the longest recent n-gram match in the
// prompt and output so far) and draft (a small draft model with the same
// vocabulary, drafting greedily).
const (
	SpeculateOff   SpeculateMode = "off"
	SpeculateNGram SpeculateMode = "ngram"
	SpeculateDraft SpeculateMode = "draft"
	// SpeculateNGramTree is ngram with branching drafts: several
	// prompt-lookup continuations in one verify pass, as a token tree
	// (tree.go).
	SpeculateNGramTree SpeculateMode = "ngram-tree"
)

// ParseSpeculateMode reads off, ngram, ngram-tree or draft ("" is off).
func ParseSpeculateMode(s string) (SpeculateMode, error) {
	switch m := SpeculateMode(s); m {
	case "", SpeculateOff:
		return SpeculateOff, nil
	case SpeculateNGram, SpeculateDraft, SpeculateNGramTree:
		return m, nil
	}
	return "", fmt.Errorf("speculate %q: want off, ngram, ngram-tree or draft", Truncate(s, 20))
}

// Speculation is the per-request extension of an OpenAI request:
// "meshgpu": {"speculate": "off"} turns speculation off for that request
// (or picks another mode the head offers). Clients may send it through the
// tracker, which forwards it as written, also on a failover's replay. It
// is embedded in openai.Continuation, the request's "meshgpu" object.
type Speculation struct {
	Speculate string `json:"speculate,omitempty"`
}

// ReplyTokens is the answer to a verify hop: count u16 | count x (token
// i32 | logprob f32 bits u32), 1 <= count <= the hop's rows. The first
// count-1 tokens are the accepted drafts, the last is the sampled one.
const ReplyTokens uint8 = 4

// HeaderVerify marks a POST /forward verify hop ("1"); its tokens travel
// in X-Meshnet-Sampling's tokens and the answer is a VerifyReply JSON.
const HeaderVerify = "X-Meshnet-Verify"

// MaxVerifyRows bounds the rows of a verify hop: the last node computes
// logits over the vocabulary for each.
const MaxVerifyRows = 65

// VerifyReply is the JSON answer of a POST /forward verify hop.
type VerifyReply struct {
	Tokens []TokenReply `json:"tokens"`
}

// Passes in flight (docs/protocol.md, "Passes in flight"): a head may send
// a session's next verify passes before the earlier ones are answered,
// each drafted as if those were accepted. Each such pass carries its
// order: Seq numbers the session's ordered passes from 1, and After is the
// pass whose cache it builds on (Seq-1 while every pass is accepted; after
// a rejection, the pass whose answer showed it, so the passes sent between
// them are stale). A node runs a pass only once it has run After, runs the
// same pass again as a retry's redo, and refuses one below a pass it has
// run (409 TypeStalePass): an earlier pass cannot overtake a later one and
// corrupt the cache.
type PassOrder struct {
	Seq, After uint32
}

// Set reports whether the hop is an ordered pass (zero: unordered).
func (o PassOrder) Set() bool { return o.Seq != 0 }

// Check validates an ordered pass's numbers.
func (o PassOrder) Check() error {
	if o.Seq == 0 || o.After >= o.Seq {
		return fmt.Errorf("wire: pass %d after pass %d: want 0 < after+1 <= pass", o.Seq, o.After)
	}
	return nil
}

// HeaderPass is an ordered pass on POST /forward: "seq,after".
const HeaderPass = "X-Meshnet-Pass"

// TypeStalePass is the error type of a pass that arrived after a later
// pass of its session ran on the node (the head has dropped it), or of an
// unordered hop to a session whose passes are ordered.
const TypeStalePass = "stale_pass"

// ParsePassOrder reads HeaderPass.
func ParsePassOrder(v string) (PassOrder, error) {
	a, b, ok := strings.Cut(v, ",")
	seq, err1 := strconv.ParseUint(strings.TrimSpace(a), 10, 32)
	after, err2 := strconv.ParseUint(strings.TrimSpace(b), 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return PassOrder{}, fmt.Errorf("want seq,after, got %q", Truncate(v, 30))
	}
	o := PassOrder{Seq: uint32(seq), After: uint32(after)}
	return o, o.Check()
}

// String is o as HeaderPass.
func (o PassOrder) String() string {
	return strconv.FormatUint(uint64(o.Seq), 10) + "," + strconv.FormatUint(uint64(o.After), 10)
}
