package pdflow

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// Placements is where the replicas tell each other which engine the heads of prompts went to,
// and how much uncached work each engine was sent lately (sharedstate.Store): read before a
// request's first pick, for both pools at once, where a pool weighs the text routed; written
// after each pick.
type Placements interface {
	// Placements answers the engine each of heads was last placed on, "" for none, and the
	// uncached tokens every replica sent each of engines lately, in one round trip within the
	// shared state's budget.
	Placements(ctx context.Context, heads []sharedstate.Head, engines []sharedstate.Sent) ([]string, []float64, error)
	// Place records, off the request path, that head went to engine for ttl.
	Place(head sharedstate.Head, engine string, ttl time.Duration)
	// AddSent records, off the request path, that engine of role's pool was sent tokens
	// uncached prompt tokens.
	AddSent(role, engine string, tokens float64)
}

// SharePlacements makes the flow read and write, through p, where the heads of prompts went,
// for the pools whose policy weighs them (router.Router.Heads).
func (f *Flow) SharePlacements(p Placements) { f.placements = p }

// placedRoles are the pools whose placements a request reads, in the order of its heads.
var placedRoles = [2]routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode}

// heads is what a request knows of where its text's heads went in one pool, and of the work
// every replica sent the engines its pick may spread it over (router.Router.SpreadEngines).
type heads struct {
	heads  []router.Head
	ttl    time.Duration
	placed []router.Placement
	spread []string
	sent   map[string]float64
}

// placed is where the replicas placed the heads of the request's text in role's pool, read
// from the shared state, for both pools in one round trip, at the request's first pick; h is
// that pick's hint. A read that fails (counted there) leaves the picks to what this replica
// routed.
func (x *Exchange) placed(role routerconfig.Role, h router.Hint) ([]router.Placement, map[string]float64) {
	if x.s.placements == nil {
		return nil, nil
	}
	if !x.headsRead {
		x.headsRead = true
		x.readPlacements(h)
	}
	hs := &x.heads[roleIndex(role)]
	return hs.placed, hs.sent
}

// readPlacements reads where the replicas placed the heads of the request's text in each
// pool: h's model and cache identity are the request's, whichever pool its pick was for.
func (x *Exchange) readPlacements(h router.Hint) {
	var want []sharedstate.Head
	var spread []sharedstate.Sent
	for i, role := range placedRoles {
		h.Text = x.HintText(role)
		hs := &x.heads[i]
		hs.heads, hs.ttl = x.s.router.Heads(role, h, x.turnEnds(h.Text))
		for _, hd := range hs.heads {
			want = append(want, sharedstate.Head{Role: string(role), Key: hd.Key})
		}
		if len(hs.heads) == 0 {
			continue // a prompt too short for a head: no round trip for its spread alone
		}
		hs.spread = x.s.router.SpreadEngines(role, h)
		for _, e := range hs.spread {
			spread = append(spread, sharedstate.Sent{Role: string(role), Engine: e})
		}
	}
	if len(want) == 0 {
		return
	}
	engines, sent, err := x.s.placements.Placements(x.Ctx, want, spread)
	if err != nil {
		return
	}
	k, j := 0, 0
	for i := range x.heads {
		hs := &x.heads[i]
		for _, hd := range hs.heads {
			if k < len(engines) && engines[k] != "" {
				hs.placed = append(hs.placed, router.Placement{Engine: engines[k], Bytes: hd.Bytes})
			}
			k++
		}
		for _, e := range hs.spread {
			if j < len(sent) && sent[j] > 0 {
				if hs.sent == nil {
					hs.sent = make(map[string]float64, len(hs.spread))
				}
				hs.sent[e] = sent[j]
			}
			j++
		}
	}
}

// place tells the other replicas where the request's heads went in role's pool, and what
// it sent there: to lease's backend.
func (x *Exchange) place(role routerconfig.Role, lease *router.Lease) {
	b := lease.Backend()
	if x.s.placements == nil || b == nil {
		return
	}
	hs := &x.heads[roleIndex(role)]
	for _, hd := range hs.heads {
		x.s.placements.Place(sharedstate.Head{Role: string(role), Key: hd.Key}, b.Name, hs.ttl)
	}
	if len(hs.spread) > 0 {
		x.s.placements.AddSent(string(role), b.Name, lease.Uncached())
	}
}

// roleIndex is role's place in placedRoles.
func roleIndex(role routerconfig.Role) int {
	if role == routerconfig.RolePrefill {
		return 0
	}
	return 1
}
