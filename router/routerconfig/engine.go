package routerconfig

import (
	"time"
)

// Engine is an engine kind as the router sees it: a value it hands back on every Backend for
// the proxy, which knows what it is, and the one fact the router's config needs of it.
type Engine interface {
	// Kind is the engine's name in config.
	Kind() string
	// KVHoldTimeout is how long a prefiller of this kind holds KV on its own: the default
	// of a backend's kv_hold_timeout.
	KVHoldTimeout() time.Duration
}

// EngineCatalog resolves the engine kinds that config names. The router keeps no list of
// its own: whoever wires the proxy passes one (cmd/proxy passes engine's).
type EngineCatalog interface {
	// Engine returns the engine of kind; "" is the default kind.
	Engine(kind string) (Engine, bool)
	// Kinds lists the kinds Engine knows, for error messages.
	Kinds() []string
}

// opaqueEngine stands for an engine kind when no catalog was given: a name and nothing else.
type opaqueEngine string

func (e opaqueEngine) Kind() string               { return string(e) }
func (opaqueEngine) KVHoldTimeout() time.Duration { return 0 }

// EngineOf resolves kind through c, or takes it as a bare name without a catalog.
func EngineOf(c EngineCatalog, kind string) (Engine, bool) {
	if c == nil {
		return opaqueEngine(kind), true
	}
	return c.Engine(kind)
}
