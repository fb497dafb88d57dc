package proxy

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/go-chi/chi/v5"
	"github.com/pdproxy/pdproxy/api"
	"go.uber.org/zap"
)

// defaultAuthOpenPaths are served without a key when keys are configured: probes and the
// metrics scraper usually have none.
var defaultAuthOpenPaths = []string{"/health", "/ready", "/metrics"}

// keyring holds the client API keys as SHA-256 digests: comparing digests of equal length
// keeps a key's length out of the timing, which comparing the raw strings would leak.
type keyring struct {
	digests [][sha256.Size]byte
	open    map[string]bool
}

// loadKeyring reads the keys the config names. Naming a source that yields no key is an
// error, never a quiet "no auth": an empty keys file would otherwise open the proxy to all.
// It returns nil when no source is configured.
func loadKeyring(cfg Config) (*keyring, error) {
	if cfg.APIKeysFile == "" && cfg.APIKeysEnv == "" {
		return nil, nil
	}
	var keys []string
	if cfg.APIKeysFile != "" {
		data, err := os.ReadFile(cfg.APIKeysFile)
		if err != nil {
			return nil, fmt.Errorf("api_keys_file: %w", err)
		}
		fromFile := parseKeysFile(data)
		if len(fromFile) == 0 {
			return nil, fmt.Errorf("api_keys_file: %s holds no key", cfg.APIKeysFile)
		}
		keys = append(keys, fromFile...)
	}
	if cfg.APIKeysEnv != "" {
		var fromEnv []string
		for k := range strings.SplitSeq(os.Getenv(cfg.APIKeysEnv), ",") {
			if k = strings.TrimSpace(k); k != "" {
				fromEnv = append(fromEnv, k)
			}
		}
		if len(fromEnv) == 0 {
			return nil, fmt.Errorf("api_keys_env: environment variable %s is unset or holds no key", cfg.APIKeysEnv)
		}
		keys = append(keys, fromEnv...)
	}
	kr := &keyring{open: make(map[string]bool)}
	for _, k := range keys {
		kr.digests = append(kr.digests, sha256.Sum256([]byte(k)))
	}
	open := cfg.AuthOpenPaths
	if open == nil {
		open = defaultAuthOpenPaths
	}
	for _, p := range open {
		if !strings.HasPrefix(p, "/") {
			return nil, fmt.Errorf("auth_open_paths: %q does not start with /", p)
		}
		kr.open[p] = true
	}
	return kr, nil
}

// parseKeysFile reads one key a line; blank lines and lines starting with # are skipped,
// and spaces around a key are not part of it.
func parseKeysFile(data []byte) []string {
	var keys []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		keys = append(keys, line)
	}
	return keys
}

// valid reports whether key is one of the keys. Every key is compared, whatever matched
// first, so the time taken does not tell which key, or whether any, came close.
func (kr *keyring) valid(key string) bool {
	d := sha256.Sum256([]byte(key))
	match := 0
	for i := range kr.digests {
		match |= subtle.ConstantTimeCompare(d[:], kr.digests[i][:])
	}
	return match == 1
}

// isOpen reports whether a path is served without a key. A path sent escaped (RawPath
// set) is never open, so that no spelling of a path can reach a route the check did not
// see.
func (kr *keyring) isOpen(r *http.Request) bool {
	return r.URL.RawPath == "" && kr.open[r.URL.Path]
}

// bearerToken is the token of an "Authorization: Bearer <token>" header (the scheme is
// case-insensitive, RFC 9110 section 11.1), and whether there was one.
func bearerToken(h string) (string, bool) {
	const scheme = "bearer "
	if len(h) < len(scheme) || !strings.EqualFold(h[:len(scheme)], scheme) {
		return "", false
	}
	tok := strings.TrimSpace(h[len(scheme):])
	return tok, tok != ""
}

// clientKey is the client's API key: the token of its Authorization header, else its
// x-api-key header (Anthropic's SDKs send the key there), and whether it sent one.
func clientKey(r *http.Request) (string, bool) {
	if tok, ok := bearerToken(r.Header.Get("Authorization")); ok {
		return tok, true
	}
	tok := strings.TrimSpace(r.Header.Get("X-Api-Key"))
	return tok, tok != ""
}

// requireKey answers 401 to a request without a valid key, before any route sees it. The
// key is never logged; only whether one was sent.
func (s *Server) requireKey(mux *chi.Mux, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.keys.isOpen(r) {
			next.ServeHTTP(w, r)
			return
		}
		tok, sent := clientKey(r)
		if sent && s.keys.valid(tok) {
			next.ServeHTTP(w, r)
			return
		}
		// The route label comes from the router's own patterns, a closed set; an unknown
		// path must not become a label. chi routes on the escaped path when there is one.
		path := r.URL.Path
		if r.URL.RawPath != "" {
			path = r.URL.RawPath
		}
		route := mux.Find(chi.NewRouteContext(), r.Method, path)
		if route == "" {
			route = "unmatched"
		}
		s.m.Requests.WithLabelValues(route, "401", "").Inc()
		msg := "invalid API key"
		if !sent {
			msg = "missing API key: send it as Authorization: Bearer <key>, or as x-api-key: <key>"
		}
		id := requestID(r)
		w.Header().Set("X-Request-Id", id)
		e := api.NewError(api.KindInvalidAPIKey, msg)
		e.BearerChallenge = true
		api.WriteError(w, e)
		if ce := s.logger.Check(zap.InfoLevel, "request refused: no valid api key"); ce != nil {
			ce.Write(zap.String("request_id", id), zap.String("route", route), zap.Bool("key_sent", sent))
		}
	})
}
