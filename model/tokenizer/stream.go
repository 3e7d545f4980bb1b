package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// StreamDecoder turns a stream of generated ids into text pieces whose
// concatenation equals Decode of all the ids (for output that is valid
// UTF-8), never emitting part of a character.
//
// It decodes a short window: the last emitted token plus the pending ones,
// and returns what the window's text gained over the text of the emitted
// token alone. Keeping one emitted token as context makes position-bound
// decoder steps (Strip, Metaspace's leading space) act the same in the
// window as in the whole. Text ending in U+FFFD is held back: it is a
// character whose remaining bytes are still to come. This is the scheme
// of Hugging Face's DecodeStream.
type StreamDecoder struct {
	t         *Tokenizer
	skip      bool
	ids       []int32 // the window
	prefix    string  // Decode of the window's already emitted tokens
	prefixLen int     // how many of ids are already emitted
}

// NewStreamDecoder starts a stream; skipSpecial drops special tokens as
// Decode does.
func (t *Tokenizer) NewStreamDecoder(skipSpecial bool) *StreamDecoder {
	return &StreamDecoder{t: t, skip: skipSpecial}
}

// Add takes the next id and returns the text it completes ("" when it
// completes none yet).
func (d *StreamDecoder) Add(id int32) string {
	d.ids = append(d.ids, id)
	s := d.t.Decode(d.ids, d.skip)
	if len(s) <= len(d.prefix) || strings.HasSuffix(s, "\uFFFD") {
		return ""
	}
	out := d.gain(s)
	// Keep the newly emitted tokens as context, drop the older ones.
	d.ids = append(d.ids[:0], d.ids[d.prefixLen:]...)
	d.prefixLen = len(d.ids)
	d.prefix = d.t.Decode(d.ids, d.skip)
	return out
}

// Flush returns the text still held back (an incomplete character comes
// out as U+FFFD) and resets the stream.
func (d *StreamDecoder) Flush() string {
	var out string
	if d.prefixLen < len(d.ids) {
		out = d.gain(d.t.Decode(d.ids, d.skip))
	}
	d.ids, d.prefix, d.prefixLen = d.ids[:0], "", 0
	return out
}

// gain is what s adds to the emitted prefix. When a later token rewrote
// earlier text (only possible for invalid UTF-8, e.g. a byte-fallback run
// that turns out ill-formed), it returns what follows the common part.
func (d *StreamDecoder) gain(s string) string {
	if strings.HasPrefix(s, d.prefix) {
		return s[len(d.prefix):]
	}
	n := 0
	for n < len(s) && n < len(d.prefix) && s[n] == d.prefix[n] {
		n++
	}
	if n >= len(s) {
		return ""
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[n:]
}
