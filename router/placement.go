package router

import (
	"encoding/binary"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/pdproxy/pdproxy/router/costmodel"
)

// Placement is where a request goes when nothing this replica knows says where it belongs: a
// prompt no engine caches yet, or a session. Every proxy replica behind a Service must then
// pick the same engine without a word between them, or they scatter the first turns of a
// conversation over the pool and no cache gets them. So the pick depends only on the key and
// the engines' names: rendezvous (highest random weight) hashing, which ranks the candidates
// by a hash of the key and each name, with bounded loads (Mirrokni et al., "Consistent Hashing
// with Bounded Loads"): the first engine in that order whose load, with this request, is at
// most ceil(c × (total load + 1) / n), so that a hot key fills its engine up to there and then
// spreads, in an order every replica agrees on too. An engine leaving the candidates moves only
// the keys it had; one joining takes about 1/n of them from the others.
//
// The load is the one load picture (Backend.loadScore): the engine's own report where the pool
// scrapes it, plus this replica's requests since, or this replica's in-flight count where
// nothing is scraped.

// SessionChoice is how a pick for a session (Hint.Session) went: the proxy counts it.
type SessionChoice string

// The session choices.
const (
	// SessionKept: the engine the session was bound to (Hint.Bound) took it.
	SessionKept SessionChoice = "kept"
	// SessionPlaced: the session had no binding; it went where its key's rendezvous order
	// with bounded loads put it.
	SessionPlaced SessionChoice = "placed"
	// SessionYieldedUnhealthy: the bound engine may not take it (down, ejected, gone from the
	// config, excluded by the hint, or not serving its model); it was placed anew.
	SessionYieldedUnhealthy SessionChoice = "yielded_unhealthy"
	// SessionYieldedLoad: the bound engine is up but at its max_inflight or over its bound
	// (or a prefiller with its KV pool nearly full); it was placed anew.
	SessionYieldedLoad SessionChoice = "yielded_load"
)

// candidatesOnStack is how many candidates Select scores without allocating.
const candidatesOnStack = 16

// loadView is one candidate's load for one pick, read once: the counts move under a pick.
type loadView struct {
	load int64
	full bool
}

// bounds is one pick's view of its candidates for bounded loads.
type bounds struct {
	cands []*Backend
	loads []loadView
	// total is the candidates' load, weights their weights.
	total   int64
	weights int
	c       float64
	// evenWeights is set when every candidate has the same weight: the rendezvous order is
	// then the order of the hashes, with no logarithm per candidate.
	evenWeights bool
}

// newBounds reads cands' loads at now into buf (pools of up to candidatesOnStack candidates
// do not allocate).
func newBounds(cands []*Backend, now time.Time, c float64, buf []loadView) bounds {
	bd := bounds{cands: cands, loads: buf[:0], c: c, evenWeights: true}
	if n := len(cands); n > len(buf) {
		bd.loads = make([]loadView, 0, n) // one allocation, not a growth by doubling
	}
	for _, b := range cands {
		bd.evenWeights = bd.evenWeights && max(b.Weight, 1) == max(cands[0].Weight, 1)
		load, full, _ := b.loadScore(now)
		bd.loads = append(bd.loads, loadView{load, full})
		bd.total += load
		bd.weights += max(b.Weight, 1)
	}
	return bd
}

// within reports whether candidate i may take one more request: its load with it is at most
// ceil(c × (total + 1) × weight / total weight), and it is not a prefiller whose KV pool is
// nearly full. With c ≥ 1 some candidate always is: the loads sum to less than total + 1.
func (bd *bounds) within(i int) bool {
	v := bd.loads[i]
	if v.full {
		return false
	}
	return costmodel.FitsBound(v.load, bd.total, max(bd.cands[i].Weight, 1), bd.weights, bd.c)
}

// pick is the index of the first candidate in key's rendezvous order that is within its
// bound; the first in that order if none is.
func (bd *bounds) pick(key uint64) int {
	best, home := -1, 0
	var bestScore, homeScore float64
	for i, b := range bd.cands {
		s := costmodel.RendezvousRank(key, b.nameHash, b.Weight, bd.evenWeights)
		if i == 0 || s > homeScore {
			home, homeScore = i, s
		}
		if (best < 0 || s > bestScore) && bd.within(i) {
			best, bestScore = i, s
		}
	}
	if best < 0 {
		return home
	}
	return best
}

// place is the candidate that key goes to at now under bounded loads with factor c.
func place(cands []*Backend, key uint64, c float64, now time.Time) *Backend {
	var buf [candidatesOnStack]loadView
	bd := newBounds(cands, now, c, buf[:])
	return cands[bd.pick(key)]
}

// placementKey is the key a prompt is placed by: a hash of its head, the first textBytes bytes
// of h.Text or, for a request without text, the first tokens of h.Tokens. The text comes first
// because every replica has it: a replica whose /tokenize call failed or came late has the
// same text as one whose call answered, and so places the prompt alike. A conversation's turns
// share their head, so they share a key while the head is no longer than the first turn. ok is
// false for a request with neither.
func placementKey(h Hint, textBytes, tokens int) (key uint64, ok bool) {
	if h.Text != "" {
		t := h.Text
		if len(t) > textBytes {
			t = t[:textBytes]
		}
		return xxhash.Sum64String(t), true
	}
	if len(h.Tokens) == 0 {
		return 0, false
	}
	ts := h.Tokens[:min(len(h.Tokens), tokens)]
	var d xxhash.Digest
	d.Reset()
	var buf [64]byte
	for len(ts) > 0 {
		n := min(len(ts), len(buf)/4)
		for i, t := range ts[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		_, _ = d.Write(buf[:4*n])
		ts = ts[n:]
	}
	return d.Sum64(), true
}

// pickRecorder is implemented by policies that learn from every pick in their pool (the text
// routed to each engine), so that a pick the pool made without them (a session's) is learnt
// too.
type pickRecorder interface {
	Picked(b *Backend, h Hint)
}

// sessionLocked picks among cands for h's session: the engine the session is bound to
// (h.Bound) while it may take the request and is within its bound, else the first within its
// bound in the rendezvous order of the session's key, which every replica computes alike with
// no state shared at all. bound is h.Bound's index in cands (-1 if not there); eligible says
// whether it could take the request but for being full.
func (p *pool) sessionLocked(cands []*Backend, h Hint, bound int, eligible bool) (*Backend, SessionChoice) {
	var buf [candidatesOnStack]loadView
	bd := newBounds(cands, p.r.now(), p.loadFactor, buf[:])
	var choice SessionChoice
	switch {
	case bound >= 0 && bd.within(bound):
		return cands[bound], SessionKept
	case h.Bound == "":
		choice = SessionPlaced
	case eligible:
		choice = SessionYieldedLoad
	default:
		choice = SessionYieldedUnhealthy
	}
	return cands[bd.pick(xxhash.Sum64String(h.Session))], choice
}
