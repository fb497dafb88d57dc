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

// loadKeyring reads the keys the config names: its api_keys_file (file), api_keys_env (env)
// and auth_open_paths (open). Naming a source that yields no key is an error, never a quiet
// "no auth": an empty keys file would otherwise open the proxy to all. It returns nil when no
// source is configured.
func loadKeyring(file, env string, open []string) (*keyring, error) {
	if file == "" && env == "" {
		return nil, nil
	}
	var keys []string
	if file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("api_keys_file: %w", err)
		}
		fromFile := parseKeysFile(data)
		if len(fromFile) == 0 {
			return nil, fmt.Errorf("api_keys_file: %s holds no key", file)
		}
		keys = append(keys, fromFile...)
	}
	if env != "" {
		var fromEnv []string
		for k := range strings.SplitSeq(os.Getenv(env), ",") {
			if k = strings.TrimSpace(k); k != "" {
				fromEnv = append(fromEnv, k)
			}
		}
		if len(fromEnv) == 0 {
			return nil, fmt.Errorf("api_keys_env: environment variable %s is unset or holds no key", env)
		}
		keys = append(keys, fromEnv...)
	}
	kr := &keyring{open: make(map[string]bool)}
	for _, k := range keys {
		kr.digests = append(kr.digests, sha256.Sum256([]byte(k)))
	}
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
