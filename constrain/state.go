package constrain

import "strings"

type kind uint8

const (
	kValue   kind = iota // a value of node is expected
	kLiteral             // true, false, null or an enum value, typed so far in lit
	kString
	kNumber
	kObject
	kArray
)

// Phases of objects.
const (
	oOpen  = iota // after '{'
	oKey          // typing a listed key (lit)
	oColon        // after a key
	oValue        // the value is on the stack above
	oAfter        // after a value: ',' or '}'
	oComma        // after ','
)

// Phases of arrays.
const (
	aOpen = iota
	aValue
	aAfter
	aComma
)

// Phases of numbers.
const (
	nStart = iota // '-' or a digit
	nMinus
	nZero // a leading 0: complete
	nInt  // integer digits: complete
	nDot  // after '.'
	nFrac // fraction digits: complete
)

// Phases of strings.
const (
	sChars = iota
	sEscape
	sHex
)

// Number sizes: no exponent, at most these many digits.
const (
	maxIntDigits  = 15
	maxFracDigits = 6
	maxKeyLen     = 64
)

var (
	boolLits = []string{"true", "false"}
	nullLits = []string{"null"}
	keyNode  = &Node{types: tString, maxLen: maxKeyLen}
)

type frame struct {
	kind   kind
	node   *Node
	phase  int
	n      int      // string: characters; number: digits of the part; object: next listed property or properties so far; array: items
	aux    int      // string: UTF-8 continuation bytes or hex digits still due; object: the chosen property
	lit    string   // literal or listed key typed so far
	cands  []string // literal: the allowed values
	isKey  bool     // a string that is a free object's key
	lo, hi byte     // string: the range of the next continuation byte
	chosen string   // tool call: the name written
}

// State is where a document is: a stack of the values being written. The
// zero value is not usable; start from NewState.
type State struct {
	stack     []frame
	limits    Limits
	depth     int    // containers on the stack
	pre, post string // literal text still due before and after the document

	// Triggered documents (NewTriggered): free text until trigger, then a
	// document of root followed by suffix, then free text again.
	trigger, suffix string
	root            *Node
	outside         bool // in free text
	matched         int  // bytes of trigger matched at the end of the free text
}

// NewState is the state before the first byte of a document of n.
func NewState(n *Node, l Limits) *State {
	return &State{stack: []frame{{kind: kValue, node: n}}, limits: l}
}

// NewWrapped is NewState for a document written between prefix and suffix
// (a tool call's "<tool_call>\n" and "\n</tool_call>").
func NewWrapped(n *Node, l Limits, prefix, suffix string) *State {
	s := NewState(n, l)
	s.pre, s.post = prefix, suffix
	return s
}

// NewTriggered is the state of free text in which each occurrence of
// trigger starts a document of n that suffix ends (a model's tool calls
// inside its answer: "<tool_call>\n", the call, "\n</tool_call>"). The text
// may end anywhere outside a document.
func NewTriggered(n *Node, l Limits, trigger, suffix string) *State {
	return &State{limits: l, trigger: trigger, suffix: suffix, root: n, outside: true}
}

// Clone copies s.
func (s *State) Clone() *State {
	c := *s
	c.stack = append(make([]frame, 0, len(s.stack)+2), s.stack...)
	return &c
}

// copyFrom makes s a copy of src, reusing s's stack.
func (s *State) copyFrom(src *State) {
	stack := append(s.stack[:0], src.stack...)
	*s = *src
	s.stack = stack
}

// Done reports whether the document is complete and nothing may follow.
func (s *State) Done() bool { return s.trigger == "" && len(s.stack) == 0 && s.post == "" }

// CanEnd reports whether the document may end here (complete, or a
// top-level number or literal that is complete).
func (s *State) CanEnd() bool {
	if s.trigger != "" && s.outside {
		return true
	}
	if s.pre != "" || s.post != "" {
		return false
	}
	if len(s.stack) == 0 {
		return true
	}
	return len(s.stack) == 1 && complete(&s.stack[0])
}

// complete: a number or literal that may end before the next byte.
func complete(f *frame) bool {
	switch f.kind {
	case kNumber:
		return f.phase == nZero || f.phase == nInt || f.phase == nFrac
	case kLiteral:
		for _, c := range f.cands {
			if c == f.lit {
				return true
			}
		}
	}
	return false
}

func hasPrefix(cands []string, p string) bool {
	for _, c := range cands {
		if strings.HasPrefix(c, p) {
			return true
		}
	}
	return false
}

// Step feeds one byte; false when no document of the schema has the bytes
// so far followed by b (s is then unusable).
func (s *State) Step(b byte) bool {
	if s.trigger != "" {
		if !s.outside && len(s.stack) == 0 && s.post == "" {
			s.outside, s.matched = true, 0 // the document ended: free text again
		}
		if s.outside {
			switch {
			case b == s.trigger[s.matched]:
				s.matched++
			case b == s.trigger[0]:
				s.matched = 1
			default:
				s.matched = 0
			}
			if s.matched == len(s.trigger) {
				s.outside, s.matched = false, 0
				s.stack = append(s.stack[:0], frame{kind: kValue, node: s.root})
				s.post, s.depth = s.suffix, 0
			}
			return true
		}
	}
	if s.pre != "" {
		if b != s.pre[0] {
			return false
		}
		s.pre = s.pre[1:]
		return true
	}
	for {
		if len(s.stack) == 0 {
			if s.post != "" && b == s.post[0] {
				s.post = s.post[1:]
				return true
			}
			return false
		}
		top := &s.stack[len(s.stack)-1]
		switch top.kind {
		case kValue:
			return s.startValue(top, b)
		case kLiteral:
			if next := top.lit + string(b); hasPrefix(top.cands, next) {
				top.lit = next
				return true
			}
			if !complete(top) {
				return false
			}
			s.pop() // the value ended; b belongs to what holds it
		case kNumber:
			if s.numberByte(top, b) {
				return true
			}
			if !complete(top) {
				return false
			}
			s.pop()
		case kString:
			return s.stringByte(top, b)
		case kObject:
			again, ok := s.objectByte(top, b)
			if !again {
				return ok
			}
		case kArray:
			again, ok := s.arrayByte(top, b)
			if !again {
				return ok
			}
		}
	}
}

// pop ends the top value and moves its holder on.
func (s *State) pop() {
	f := s.stack[len(s.stack)-1]
	s.stack = s.stack[:len(s.stack)-1]
	if f.kind == kObject || f.kind == kArray {
		s.depth--
	}
	if len(s.stack) == 0 {
		return
	}
	p := &s.stack[len(s.stack)-1]
	if p.kind == kObject && p.node.byName != nil && p.aux == 0 && f.kind == kLiteral {
		p.chosen = f.lit // the tool's name: its arguments' schema follows
	}
	switch {
	case p.kind == kObject && f.isKey:
		p.phase = oColon
	case p.kind == kObject:
		p.phase = oAfter
	case p.kind == kArray:
		p.phase = aAfter
		p.n++
	}
}

func (s *State) startValue(f *frame, b byte) bool {
	n := f.node
	if n.enum != nil {
		if !hasPrefix(n.enum, string(b)) {
			return false
		}
		*f = frame{kind: kLiteral, node: n, cands: n.enum, lit: string(b)}
		return true
	}
	switch {
	case b == '{' && n.types&tObject != 0 && s.depth < s.limits.MaxDepth:
		*f = frame{kind: kObject, node: n, phase: oOpen}
		s.depth++
	case b == '[' && n.types&tArray != 0 && s.depth < s.limits.MaxDepth:
		*f = frame{kind: kArray, node: n, phase: aOpen}
		s.depth++
	case b == '"' && n.types&tString != 0:
		*f = frame{kind: kString, node: n, phase: sChars, isKey: f.isKey}
	case (b == '-' || b >= '0' && b <= '9') && n.types&(tNumber|tInteger) != 0:
		*f = frame{kind: kNumber, node: n, phase: nStart}
		return s.numberByte(f, b)
	case (b == 't' || b == 'f') && n.types&tBoolean != 0:
		*f = frame{kind: kLiteral, node: n, cands: boolLits, lit: string(b)}
	case b == 'n' && n.types&tNull != 0:
		*f = frame{kind: kLiteral, node: n, cands: nullLits, lit: "n"}
	default:
		return false
	}
	return true
}

func (s *State) numberByte(f *frame, b byte) bool {
	digit := b >= '0' && b <= '9'
	switch f.phase {
	case nStart, nMinus:
		switch {
		case b == '-' && f.phase == nStart:
			f.phase = nMinus
		case b == '0':
			f.phase = nZero
		case digit:
			f.phase, f.n = nInt, 1
		default:
			return false
		}
	case nZero, nInt:
		switch {
		case digit && f.phase == nInt && f.n < maxIntDigits:
			f.n++
		case b == '.' && f.node.types&tNumber != 0:
			f.phase, f.n = nDot, 0
		default:
			return false
		}
	case nDot, nFrac:
		if !digit || f.n >= maxFracDigits {
			return false
		}
		f.phase = nFrac
		f.n++
	}
	return true
}

func (s *State) stringByte(f *frame, b byte) bool {
	max := f.node.maxLen
	if max < 0 {
		max = s.limits.MaxString
	}
	switch f.phase {
	case sEscape:
		switch b {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			f.phase = sChars
			f.n++
		case 'u':
			f.phase, f.aux = sHex, 4
		default:
			return false
		}
		return true
	case sHex:
		if !(b >= '0' && b <= '9' || b >= 'a' && b <= 'f' || b >= 'A' && b <= 'F') {
			return false
		}
		if f.aux--; f.aux == 0 {
			f.phase = sChars
			f.n++
		}
		return true
	}
	switch {
	case f.aux > 0: // inside a multi-byte character
		if b < f.lo || b > f.hi {
			return false
		}
		f.aux--
		f.lo, f.hi = 0x80, 0xBF
	case b == '"':
		if f.n < f.node.minLen {
			return false
		}
		s.pop()
	case f.n >= max || b < 0x20 || b == 0x7F:
		return false
	case b == '\\':
		f.phase = sEscape
	case b < 0x80:
		f.n++
	case b >= 0xC2 && b <= 0xF4:
		// UTF-8 (RFC 3629): no overlong forms, no surrogates, at most U+10FFFF
		f.n++
		f.lo, f.hi = 0x80, 0xBF
		switch {
		case b <= 0xDF:
			f.aux = 1
		case b <= 0xEF:
			f.aux = 2
			if b == 0xE0 {
				f.lo = 0xA0
			} else if b == 0xED {
				f.hi = 0x9F
			}
		default:
			f.aux = 3
			if b == 0xF0 {
				f.lo = 0x90
			} else if b == 0xF4 {
				f.hi = 0x8F
			}
		}
	default:
		return false
	}
	return true
}

// candidates are the listed properties that may come next: in schema
// order, from the cursor up to the first required one.
func candidates(n *Node, cursor int) []prop {
	for j := cursor; j < len(n.props); j++ {
		if n.props[j].required {
			return n.props[cursor : j+1]
		}
	}
	return n.props[cursor:]
}

func requiredLeft(n *Node, cursor int) bool {
	for _, p := range n.props[cursor:] {
		if p.required {
			return true
		}
	}
	return false
}

// objectByte handles b in an object; again: b is for a value just pushed.
func (s *State) objectByte(f *frame, b byte) (again, ok bool) {
	n := f.node
	listed := len(n.props) > 0
	switch f.phase {
	case oOpen, oComma:
		switch {
		case b == '}' && f.phase == oOpen && (!listed || !requiredLeft(n, 0)):
			s.pop()
			return false, true
		case b == '"' && listed:
			if len(candidates(n, f.n)) == 0 {
				return false, false
			}
			f.phase, f.lit = oKey, `"`
			return false, true
		case b == '"' && n.free != nil && f.n < s.limits.MaxProperties:
			f.phase = oKey // the key is the string above
			s.stack = append(s.stack, frame{kind: kString, node: keyNode, phase: sChars, isKey: true})
			return false, true
		}
		return false, false
	case oKey:
		next := f.lit + string(b)
		for i, p := range candidates(n, f.n) {
			if p.key == next {
				f.aux = f.n + i
				f.n, f.phase = f.aux+1, oColon
				return false, true
			}
		}
		for _, p := range candidates(n, f.n) {
			if strings.HasPrefix(p.key, next) {
				f.lit = next
				return false, true
			}
		}
		return false, false
	case oColon:
		if b != ':' {
			return false, false
		}
		child := n.free
		if listed {
			child = n.props[f.aux].node
			if n.byName != nil && f.aux == 1 {
				child = n.byName[f.chosen]
			}
		} else {
			f.n++
		}
		f.phase = oValue
		s.stack = append(s.stack, frame{kind: kValue, node: child})
		return false, true
	case oAfter:
		switch {
		case b == '}' && (!listed || !requiredLeft(n, f.n)):
			s.pop()
			return false, true
		case b == ',' && listed && f.n < len(n.props):
			f.phase = oComma
			return false, true
		case b == ',' && !listed && f.n < s.limits.MaxProperties:
			f.phase = oComma
			return false, true
		}
	}
	return false, false
}

func (s *State) arrayByte(f *frame, b byte) (again, ok bool) {
	n := f.node
	max := n.maxItems
	if max < 0 {
		max = s.limits.MaxItems
	}
	switch f.phase {
	case aOpen:
		if b == ']' {
			if n.minItems > 0 {
				return false, false
			}
			s.pop()
			return false, true
		}
		if max == 0 {
			return false, false
		}
		f.phase = aValue
		s.stack = append(s.stack, frame{kind: kValue, node: n.items})
		return true, true
	case aAfter:
		switch {
		case b == ']' && f.n >= n.minItems:
			s.pop()
			return false, true
		case b == ',' && f.n < max:
			f.phase = aComma
			return false, true
		}
	case aComma:
		f.phase = aValue
		s.stack = append(s.stack, frame{kind: kValue, node: n.items})
		return true, true
	}
	return false, false
}
