package relay

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"
)

// envelope is the JSON message of ADR-0014 (/rpc) and ADR-0010 (/ws):
// relay-http-request and relay-http-response. Bodies travel as
// body_base64 (binary) or body (text). The codec below streams the base64
// straight between the body []byte and the WebSocket message, so a hop
// never builds an intermediate base64 string.
type envelope struct {
	Type      string
	RequestID string
	Method    string
	Path      string
	Status    int
	Header    http.Header
	Body      []byte
	// Text sends Body as "body" (a JSON string) instead of body_base64.
	Text bool
	// Message is set on {"type":"error"} messages.
	Message string
}

const (
	typeHTTPRequest  = "relay-http-request"
	typeHTTPResponse = "relay-http-response"
)

// textBody says whether a response body goes out as "body" (text) rather than
// body_base64: JSON and text/* content that is valid UTF-8, as the ADR asks.
func textBody(h http.Header, body []byte) bool {
	ct := h.Get("Content-Type")
	if ct == "" {
		return false
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false
	}
	if mt != "application/json" && !strings.HasPrefix(mt, "text/") {
		return false
	}
	return utf8.Valid(body)
}

// base64 is written in chunks from a pooled buffer; 3072 input bytes make
// exactly 4096 output bytes, so chunks never need padding.
const b64Chunk = 3072

var b64Pool = sync.Pool{New: func() any { b := make([]byte, 4096); return &b }}

var prefixPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// writeEnvelope streams e as one JSON object into w.
func writeEnvelope(w io.Writer, e *envelope) error {
	bp := prefixPool.Get().(*[]byte)
	defer prefixPool.Put(bp)
	b := (*bp)[:0]
	b = append(b, '{')
	sep := false
	field := func(k string) {
		if sep {
			b = append(b, ',')
		}
		sep = true
		b = append(b, '"')
		b = append(b, k...)
		b = append(b, '"', ':')
	}
	if e.Type != "" {
		field("type")
		b = appendJSONString(b, e.Type)
	}
	field("request_id")
	b = appendJSONString(b, e.RequestID)
	if e.Method != "" {
		field("method")
		b = appendJSONString(b, e.Method)
	}
	if e.Path != "" {
		field("path")
		b = appendJSONString(b, e.Path)
	}
	if e.Status != 0 {
		field("status")
		b = strconv.AppendInt(b, int64(e.Status), 10)
	}
	if e.Message != "" {
		field("message")
		b = appendJSONString(b, e.Message)
	}
	field("headers")
	b = append(b, '{')
	keys := make([]string, 0, len(e.Header))
	for k := range e.Header {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		// The ADR shows one string per header; several values join with
		// ", " as HTTP allows.
		b = appendJSONString(b, strings.Join(e.Header[k], ", "))
	}
	b = append(b, '}')
	if e.Text {
		field("body")
		b = appendJSONString(b, string(e.Body))
		b = append(b, '}')
		*bp = b
		_, err := w.Write(b)
		return err
	}
	field("body_base64")
	b = append(b, '"')
	*bp = b
	if _, err := w.Write(b); err != nil {
		return err
	}
	cp := b64Pool.Get().(*[]byte)
	defer b64Pool.Put(cp)
	chunk := *cp
	for body := e.Body; len(body) > 0; {
		n := min(len(body), b64Chunk)
		m := base64.StdEncoding.EncodedLen(n)
		base64.StdEncoding.Encode(chunk[:m], body[:n])
		if _, err := w.Write(chunk[:m]); err != nil {
			return err
		}
		body = body[n:]
	}
	_, err := w.Write([]byte(`"}`))
	return err
}

// envelopeFits reports whether e encodes within limit bytes (limit <= 0:
// no limit) and, when it does not, its encoded size. Envelopes whose worst
// case (every byte escaped as \u00XX) fits are not encoded to find out.
func envelopeFits(e *envelope, limit int64) (bool, int64) {
	if limit <= 0 {
		return true, 0
	}
	bound := 256 + 6*(len(e.Type)+len(e.RequestID)+len(e.Method)+len(e.Path)+len(e.Message)+len(e.Body))
	for k, vs := range e.Header {
		for _, v := range vs {
			bound += 6*(len(k)+len(v)) + 8
		}
	}
	if int64(bound) <= limit {
		return true, 0
	}
	cw := countingWriter{w: io.Discard}
	writeEnvelope(&cw, e)
	return int64(cw.n) <= limit, int64(cw.n)
}

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD,
// as encoding/json does.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c >= 0x20:
				b = append(b, c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}

var errNotObject = errors.New("envelope: message is not a JSON object")

// parseEnvelope reads one envelope from msg. body_base64 is decoded straight
// from msg into a buffer of exactly the decoded size: the only copy of the
// body. Other fields are small and parsed with encoding/json.
func parseEnvelope(msg []byte) (*envelope, error) {
	e := &envelope{}
	i := skipWS(msg, 0)
	if i >= len(msg) || msg[i] != '{' {
		return nil, errNotObject
	}
	i = skipWS(msg, i+1)
	if i < len(msg) && msg[i] == '}' {
		return e, nil
	}
	for {
		if i >= len(msg) || msg[i] != '"' {
			return nil, errNotObject
		}
		kend, err := skipValue(msg, i)
		if err != nil {
			return nil, err
		}
		key, err := jsonString(msg[i:kend])
		if err != nil {
			return nil, err
		}
		i = skipWS(msg, kend)
		if i >= len(msg) || msg[i] != ':' {
			return nil, errNotObject
		}
		vs := skipWS(msg, i+1)
		ve, err := skipValue(msg, vs)
		if err != nil {
			return nil, err
		}
		if err := e.setField(key, msg[vs:ve]); err != nil {
			return nil, fmt.Errorf("envelope field %q: %w", key, err)
		}
		i = skipWS(msg, ve)
		if i >= len(msg) {
			return nil, errNotObject
		}
		if msg[i] == '}' {
			break
		}
		if msg[i] != ',' {
			return nil, errNotObject
		}
		i = skipWS(msg, i+1)
	}
	if rest := skipWS(msg, i+1); rest != len(msg) {
		return nil, errors.New("envelope: trailing data after the JSON object")
	}
	return e, nil
}

func (e *envelope) setField(key string, v []byte) error {
	var err error
	switch key {
	case "type":
		e.Type, err = jsonString(v)
	case "request_id":
		// Accept a number too: some clients send numeric ids.
		if len(v) > 0 && v[0] != '"' {
			if _, perr := strconv.ParseFloat(string(v), 64); perr != nil {
				return errors.New("must be a string or a number")
			}
			e.RequestID = string(v)
			return nil
		}
		e.RequestID, err = jsonString(v)
	case "method":
		e.Method, err = jsonString(v)
	case "path":
		e.Path, err = jsonString(v)
	case "message":
		e.Message, err = jsonString(v)
	case "status":
		n, perr := strconv.Atoi(string(v))
		if perr != nil || n < 100 || n > 999 {
			return errors.New("must be an HTTP status number")
		}
		e.Status = n
	case "headers":
		if string(v) == "null" {
			return nil
		}
		h, err := parseHeaders(v)
		if err != nil {
			return err
		}
		e.Header = h
	case "body_base64":
		if string(v) == "null" {
			return nil
		}
		if len(v) < 2 || v[0] != '"' {
			return errors.New("must be a string")
		}
		src := v[1 : len(v)-1]
		if hasByte(src, '\\') {
			// Escaped base64 ("\/") is legal JSON; take the slow path.
			s, err := jsonString(v)
			if err != nil {
				return err
			}
			src = []byte(s)
		}
		n := len(src) / 4 * 3 // exact size: the buffer is the body, no slack
		if len(src)%4 != 0 {
			return errors.New("base64 length must be a multiple of 4")
		}
		if len(src) > 0 && src[len(src)-1] == '=' {
			n--
			if len(src) > 1 && src[len(src)-2] == '=' {
				n--
			}
		}
		dst := make([]byte, n)
		n, err := base64.StdEncoding.Decode(dst, src)
		if err != nil {
			return err
		}
		e.Body = dst[:n]
	case "body":
		if string(v) == "null" {
			return nil
		}
		s, err := jsonString(v)
		if err != nil {
			return err
		}
		e.Body = []byte(s)
		e.Text = true
	}
	return err
}

// parseHeaders reads {"name": "value" | ["v1", ...], ...} by hand, so a
// hop's few headers cost a map and their strings only.
func parseHeaders(v []byte) (http.Header, error) {
	i := skipWS(v, 0)
	if i >= len(v) || v[i] != '{' {
		return nil, errors.New("must be an object")
	}
	h := http.Header{}
	i = skipWS(v, i+1)
	if i < len(v) && v[i] == '}' {
		return h, nil
	}
	for {
		if i >= len(v) || v[i] != '"' {
			return nil, errNotObject
		}
		kend, err := skipValue(v, i)
		if err != nil {
			return nil, err
		}
		k, err := jsonString(v[i:kend])
		if err != nil {
			return nil, err
		}
		i = skipWS(v, kend)
		if i >= len(v) || v[i] != ':' {
			return nil, errNotObject
		}
		vs := skipWS(v, i+1)
		ve, err := skipValue(v, vs)
		if err != nil {
			return nil, err
		}
		ck := http.CanonicalHeaderKey(k)
		if s, err := jsonString(v[vs:ve]); err == nil {
			h[ck] = append(h[ck], s)
		} else {
			var ss []string
			if err := json.Unmarshal(v[vs:ve], &ss); err != nil {
				return nil, fmt.Errorf("header %q must be a string or a list of strings", k)
			}
			h[ck] = append(h[ck], ss...)
		}
		i = skipWS(v, ve)
		if i >= len(v) {
			return nil, errNotObject
		}
		if v[i] == '}' {
			return h, nil
		}
		if v[i] != ',' {
			return nil, errNotObject
		}
		i = skipWS(v, i+1)
	}
}

func hasByte(b []byte, c byte) bool {
	for _, x := range b {
		if x == c {
			return true
		}
	}
	return false
}

// jsonString decodes a JSON string literal; the common unescaped case
// avoids encoding/json.
func jsonString(v []byte) (string, error) {
	if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
		inner := v[1 : len(v)-1]
		plain := utf8.Valid(inner)
		for _, c := range inner {
			if c == '\\' || c < 0x20 {
				plain = false
				break
			}
		}
		if plain {
			return string(inner), nil
		}
	}
	var s string
	if err := json.Unmarshal(v, &s); err != nil {
		return "", errors.New("must be a string")
	}
	return s, nil
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

var errBadJSON = errors.New("envelope: malformed JSON")

// skipValue returns the end of the JSON value starting at b[i]. It checks
// structure only; values that are used are validated when decoded.
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errBadJSON
	}
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1, nil
			}
		}
		return 0, errBadJSON
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipValue(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
				if depth > 64 {
					return 0, errors.New("envelope: JSON nested too deeply")
				}
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errBadJSON
	default:
		j := i
		for j < len(b) {
			c := b[j]
			if c == ',' || c == '}' || c == ']' || c == ' ' || c == '\t' || c == '\n' || c == '\r' {
				break
			}
			j++
		}
		if j == i {
			return 0, errBadJSON
		}
		return j, nil
	}
}
