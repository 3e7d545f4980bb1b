// Package apiauth guards the OpenAI endpoints (/v1/...) of a head and of
// the tracker: API keys as "Authorization: Bearer KEY" and CORS for the
// browser origins an operator lists. Hop and control endpoints are never
// covered: they are authenticated by tickets and signatures, not by keys a
// client holds.
package apiauth

import (
	"bufio"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"

	"meshgpu/wire"
)

// Config is what a head or tracker operator sets. The zero value lets
// every request through and answers no CORS preflight.
type Config struct {
	// Keys are the accepted API keys; empty: no key needed.
	Keys []string
	// AllowedOrigins are the browser origins (scheme://host[:port]) whose
	// cross-origin requests are allowed; "*" allows any.
	AllowedOrigins []string
}

// Enabled reports whether the middleware does anything.
func (c Config) Enabled() bool { return len(c.Keys) > 0 || len(c.AllowedOrigins) > 0 }

// Prefix is the path prefix covered.
const Prefix = "/v1/"

// CORS answers, fixed: the OpenAI API is GET and POST with a JSON body.
const (
	allowMethods = "GET, POST, OPTIONS"
	allowHeaders = "Authorization, Content-Type"
	maxAge       = "600"
)

// Middleware wraps next so that requests under Prefix need a key (when
// cfg has keys) and get CORS headers for the allowed origins. Other paths
// go straight to next.
func Middleware(cfg Config, next http.Handler) http.Handler {
	if !cfg.Enabled() {
		return next
	}
	// Keys are compared as SHA-256 digests: equal lengths, so the
	// constant-time compare does not leak a key's length either.
	digests := make([][32]byte, len(cfg.Keys))
	for i, k := range cfg.Keys {
		digests[i] = sha256.Sum256([]byte(k))
	}
	origins := map[string]bool{}
	for _, o := range cfg.AllowedOrigins {
		origins[strings.TrimRight(o, "/")] = true
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, Prefix) {
			next.ServeHTTP(w, r)
			return
		}
		origin := r.Header.Get("Origin")
		allowed := origin != "" && (origins[origin] || origins["*"])
		if allowed {
			h := w.Header()
			if origins["*"] {
				h.Set("Access-Control-Allow-Origin", "*")
			} else {
				h.Set("Access-Control-Allow-Origin", origin)
				h.Add("Vary", "Origin")
			}
		}
		// A preflight carries no credentials: answer it before the key check.
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			if !allowed {
				writeError(w, http.StatusForbidden, "permission_error", "origin_not_allowed",
					fmt.Sprintf("origin %q is not allowed (--allowed-origins)", origin))
				return
			}
			h := w.Header()
			h.Set("Access-Control-Allow-Methods", allowMethods)
			h.Set("Access-Control-Allow-Headers", allowHeaders)
			h.Set("Access-Control-Max-Age", maxAge)
			w.WriteHeader(http.StatusNoContent)
			return
		}
		if len(digests) > 0 && !validKey(digests, r.Header.Get("Authorization")) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="meshgpu"`)
			writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key",
				"missing or invalid API key: send Authorization: Bearer <key>")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// validKey checks "Bearer KEY" against every digest (all of them, so the
// time taken does not say which key matched).
func validKey(digests [][32]byte, header string) bool {
	scheme, key, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || key == "" {
		return false
	}
	d := sha256.Sum256([]byte(strings.TrimSpace(key)))
	match := 0
	for i := range digests {
		match |= subtle.ConstantTimeCompare(d[:], digests[i][:])
	}
	return match == 1
}

func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	wire.WriteError(w, &wire.Error{Status: status, Type: typ, Code: code, Message: msg})
}

// LoadKeys returns keys and the keys of file (one per line; blank lines
// and lines starting with # are skipped). A file that gives no key is an
// error: an operator who names one means to require keys.
func LoadKeys(keys []string, file string) ([]string, error) {
	var out []string
	for _, k := range keys {
		if err := checkKey(k); err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	if file == "" {
		return out, nil
	}
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("API key file: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	for line := 1; sc.Scan(); line++ {
		k := strings.TrimSpace(sc.Text())
		if k == "" || strings.HasPrefix(k, "#") {
			continue
		}
		if err := checkKey(k); err != nil {
			return nil, fmt.Errorf("API key file %s line %d: %w", file, line, err)
		}
		out = append(out, k)
		n++
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("API key file %s: %w", file, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("API key file %s has no key", file)
	}
	return out, nil
}

func checkKey(k string) error {
	if k == "" || strings.ContainsAny(k, " \t\r\n") {
		return errors.New("an API key must be non-empty and contain no whitespace")
	}
	if len(k) > 512 {
		return errors.New("an API key is longer than 512 bytes")
	}
	return nil
}

// CheckOrigins validates --allowed-origins values.
func CheckOrigins(origins []string) error {
	for _, o := range origins {
		if o == "*" {
			continue
		}
		scheme, host, ok := strings.Cut(strings.TrimRight(o, "/"), "://")
		if !ok || (scheme != "http" && scheme != "https") || host == "" || strings.ContainsAny(host, "/?#@ ") {
			return fmt.Errorf("allowed origin %q: want scheme://host[:port] or *", o)
		}
	}
	return nil
}
