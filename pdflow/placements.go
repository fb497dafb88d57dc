package pdflow

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Placements is where the replicas tell each other which engine the heads of prompts went to
// (sharedstate.Store): read before a pick of a pool that sees the caches by the text routed,
// written after it.
type Placements interface {
	// Placements answers the engine each of keys was last placed on for role, "" for none,
	// within the shared state's budget.
	Placements(ctx context.Context, role string, keys []string) ([]string, error)
	// Place records, off the request path, that the head key of role went to engine for ttl.
	Place(role, key, engine string, ttl time.Duration)
}

// SharePlacements makes the flow read and write, through p, where the heads of prompts went,
// for the pools whose policy weighs them (router.Router.Heads).
func (f *Flow) SharePlacements(p Placements) { f.placements = p }

// heads is what a request knows of where its text's heads went, for one role: read once,
// at its first pick of the role.
type heads struct {
	read   bool
	heads  []router.Head
	ttl    time.Duration
	placed []router.Placement
}

// placed is where the replicas placed the heads of h's text for role, read from the shared
// state at the request's first pick of the role. A read that fails (counted there) leaves the
// pick to what this replica routed.
func (x *Exchange) placed(role routerconfig.Role, h router.Hint) []router.Placement {
	hs := x.headsOf(role)
	if hs == nil {
		return nil
	}
	if hs.read {
		return hs.placed
	}
	hs.read = true
	hs.heads, hs.ttl = x.s.router.Heads(role, h)
	if len(hs.heads) == 0 {
		return nil
	}
	keys := make([]string, len(hs.heads))
	for i, hd := range hs.heads {
		keys[i] = hd.Key
	}
	engines, err := x.s.placements.Placements(x.Ctx, string(role), keys)
	if err != nil {
		return nil
	}
	for i, e := range engines {
		if e != "" && i < len(hs.heads) {
			hs.placed = append(hs.placed, router.Placement{Engine: e, Bytes: hs.heads[i].Bytes})
		}
	}
	return hs.placed
}

// place tells the other replicas where the request's heads went for role: to b.
func (x *Exchange) place(role routerconfig.Role, b *router.Backend) {
	hs := x.headsOf(role)
	if hs == nil || b == nil {
		return
	}
	for _, hd := range hs.heads {
		x.s.placements.Place(string(role), hd.Key, b.Name, hs.ttl)
	}
}

// headsOf is the request's heads for role; nil when the flow shares no placements.
func (x *Exchange) headsOf(role routerconfig.Role) *heads {
	if x.s.placements == nil {
		return nil
	}
	if role == routerconfig.RolePrefill {
		return &x.heads[0]
	}
	return &x.heads[1]
}
