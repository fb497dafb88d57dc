package proxy

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// SessionAffinityConfig sends the requests of one session (a conversation, an agent's run) to
// one decoder and one prefiller, whichever replica each reaches: where the session's earlier
// turns left their KV. A request names its session in the first of Headers it carries; the
// router then keeps it on the engine the session is bound to while that engine is usable and
// within its bound, and places it by the session's key otherwise (the same choice on every
// replica, with nothing shared). With shared_state, the binding of each role is kept there
// for TTL after the session's last request, so that a session that had to move stays where it
// moved to; without it, the key alone decides.
type SessionAffinityConfig struct {
	// Headers are the request headers that name a session, the first one present winning.
	// Common ones: X-Session-ID (vLLM's router), X-Dynamo-Session-ID, X-Claude-Code-Session-Id
	// (Claude Code), Session-Id and Session_id (Codex), X-Session-Affinity and
	// X-Opencode-Session (OpenCode). Empty, the default, means session affinity is off.
	Headers []string `yaml:"headers"`
	// TTL is how long a binding kept in shared_state outlives its session's last request.
	// It takes effect only with shared_state. [DefaultSessionTTL]
	TTL time.Duration `yaml:"ttl"`
}

const (
	// DefaultSessionTTL is session_affinity.ttl when it is not set.
	DefaultSessionTTL = 30 * time.Minute
	// maxSessionKey bounds a session header's value: an id, not a payload. It becomes a
	// key in shared state.
	maxSessionKey = 256
)

func (c *SessionAffinityConfig) setDefaults() error {
	if c.TTL < 0 {
		return fmt.Errorf("session_affinity.ttl: %v is negative", c.TTL)
	}
	if len(c.Headers) == 0 {
		if c.TTL > 0 {
			return fmt.Errorf("session_affinity.ttl: set without headers, which name the sessions: nothing would be bound")
		}
		return nil
	}
	for i, h := range c.Headers {
		if h == "" || strings.ContainsFunc(h, func(r rune) bool { return !isTokenRune(r) }) {
			return fmt.Errorf("session_affinity.headers[%d]: %q is not a header name", i, h)
		}
		c.Headers[i] = http.CanonicalHeaderKey(h)
	}
	if c.TTL == 0 {
		c.TTL = DefaultSessionTTL
	}
	return nil
}

// isTokenRune reports whether r may be part of an HTTP header name (RFC 9110's tchar).
func isTokenRune(r rune) bool {
	switch {
	case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		return true
	}
	return strings.ContainsRune("!#$%&'*+-.^_`|~", r)
}

// sessionOf is the session r names in the first of headers it carries, "" when none. A value
// too long to be an id, or with bytes that are not printable ASCII, is refused: it would
// become a key in shared state.
func sessionOf(r *http.Request, headers []string) (string, *api.Error) {
	for _, h := range headers {
		v := r.Header.Get(h)
		if v == "" {
			continue
		}
		if len(v) > maxSessionKey || !printable(v) {
			return "", api.NewError(api.KindInvalidValue, fmt.Sprintf("the %s header must be a session id of at most %d printable ASCII characters", h, maxSessionKey)).
				With(h, nil, 0)
		}
		return v, nil
	}
	return "", nil
}

// textField is the field of a session's binding that keeps how many bytes of its text the
// latest request sent the engine of role: what that engine holds of the conversation, for a
// replica that did not route it.
func textField(role routerconfig.Role) string { return string(role) + "_text" }

// boundBytes reads a textField's value: a count of bytes, 0 for anything else.
func boundBytes(v string) int {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > math.MaxInt32 {
		return 0
	}
	return n
}
