package constrain

// The closing cost of a state is the fewest bytes that complete the
// document from it. Every step of a closing path lowers it by one, and a
// byte-level vocabulary has a one-byte token for each, so a generation that
// keeps the cost below its remaining tokens always ends with a complete
// document (Vocab.Allowed's budget).

const unreachable = 1 << 30

// minValue is the fewest bytes of a value of n, computed once per node:
// the trie walk asks for it at every token, and the schema comes from the
// network, so its size must not multiply the walk's work.
func minValue(n *Node) int {
	n.minOnce.Do(func() { n.min = minValueSeen(n, map[*Node]bool{}) })
	return n.min
}

func minValueSeen(n *Node, seen map[*Node]bool) int {
	if n.enum != nil {
		best := unreachable
		for _, e := range n.enum {
			best = min(best, len(e))
		}
		return best
	}
	if seen[n] {
		return unreachable // a cycle: another branch is shorter
	}
	if len(seen) > 64 {
		return unreachable // deeper than any schema Compile accepts
	}
	seen[n] = true
	defer delete(seen, n)
	best := unreachable
	if n.types&(tNumber|tInteger) != 0 {
		best = 1
	}
	if n.types&(tBoolean|tNull) != 0 {
		best = min(best, 4)
	}
	if n.types&tString != 0 {
		best = min(best, 2+n.minLen)
	}
	if n.types&tObject != 0 {
		best = min(best, 1+restProps(n, 0, true, seen))
	}
	if n.types&tArray != 0 {
		c := 2
		if n.minItems > 0 {
			c += n.minItems*minValueSeen(n.items, seen) + n.minItems - 1
		}
		best = min(best, c)
	}
	return best
}

// restProps is the fewest bytes that write the required properties from
// index from on and close the object; first: no comma before the first.
// Suffix sums are computed once per node (see minValue).
func restProps(n *Node, from int, first bool, seen map[*Node]bool) int {
	n.restOnce.Do(func() {
		n.restBytes = make([]int, len(n.props)+1)
		n.restCount = make([]int, len(n.props)+1)
		for i := len(n.props) - 1; i >= 0; i-- {
			p := n.props[i]
			n.restBytes[i], n.restCount[i] = n.restBytes[i+1], n.restCount[i+1]
			if p.required {
				n.restBytes[i] = min(unreachable, n.restBytes[i]+len(p.key)+1+minValueSeen(p.node, seen))
				n.restCount[i]++
			}
		}
	})
	c := 1 + n.restBytes[from] + n.restCount[from] // '}', the properties, a comma before each
	if first && n.restCount[from] > 0 {
		c--
	}
	return min(c, unreachable)
}

// Cost is the closing cost of s.
func (s *State) Cost() int {
	if s.trigger != "" && (s.outside || len(s.stack) == 0 && s.post == "") {
		return 0
	}
	total := len(s.pre) + len(s.post)
	for i := range s.stack {
		total += frameCost(&s.stack[i])
		if total >= unreachable {
			return unreachable
		}
	}
	return total
}

func frameCost(f *frame) int {
	seen := map[*Node]bool{}
	n := f.node
	switch f.kind {
	case kValue:
		return minValue(n)
	case kLiteral:
		best := unreachable
		for _, c := range f.cands {
			if len(c) >= len(f.lit) && c[:len(f.lit)] == f.lit {
				best = min(best, len(c)-len(f.lit))
			}
		}
		return best
	case kNumber:
		if f.phase == nStart || f.phase == nMinus || f.phase == nDot {
			return 1
		}
		return 0
	case kString:
		switch f.phase {
		case sEscape: // one byte completes the escaped character
			return 1 + max(0, n.minLen-f.n-1) + 1
		case sHex:
			return f.aux + max(0, n.minLen-f.n-1) + 1
		}
		return f.aux + max(0, n.minLen-f.n) + 1 // continuation bytes, characters short of minLength, the quote
	case kObject:
		if len(n.props) == 0 {
			switch f.phase {
			case oKey, oColon: // the key is written or on the stack above
				return 1 + minValue(n.free) + 1
			case oComma:
				return 2 + 1 + minValue(n.free) + 1
			}
			return 1
		}
		switch f.phase {
		case oOpen:
			return restProps(n, 0, true, seen)
		case oKey, oComma:
			best := unreachable
			for i, p := range candidates(n, f.n) {
				typed := 0
				if f.phase == oKey {
					if len(p.key) < len(f.lit) || p.key[:len(f.lit)] != f.lit {
						continue
					}
					typed = len(f.lit)
				}
				best = min(best, len(p.key)-typed+1+minValue(p.node)+restProps(n, f.n+i+1, false, seen))
			}
			return best
		case oColon:
			child := n.props[f.aux].node
			if n.byName != nil && f.aux == 1 {
				child = n.byName[f.chosen]
			}
			return 1 + minValue(child) + restProps(n, f.n, false, seen)
		}
		return restProps(n, f.n, false, seen) // oValue, oAfter
	case kArray:
		item := minValue(n.items)
		need := func(have int) int { return max(0, n.minItems-have) * (1 + item) }
		switch f.phase {
		case aOpen:
			if n.minItems == 0 {
				return 1
			}
			return n.minItems*item + n.minItems - 1 + 1
		case aValue:
			return need(f.n+1) + 1
		case aComma:
			return item + need(f.n+1) + 1
		}
		return need(f.n) + 1
	}
	return 0
}
