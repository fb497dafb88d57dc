package kvcache

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

func TestTableKeepsWhatAMapKeeps(t *testing.T) {
	// Keys an engine numbers in sequence, random ones, and 0 (whose mix is 0, held apart),
	// put, overwritten and deleted at random, across growing and shrinking.
	tests := []struct {
		name string
		key  func(r *rand.Rand) uint64
	}{
		{"random keys", func(r *rand.Rand) uint64 { return r.Uint64() }},
		{"keys in a small range, 0 among them", func(r *rand.Rand) uint64 { return r.Uint64N(5000) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, 2))
			var tb table[uint32]
			want := map[uint64]uint32{}
			var keys []uint64
			for i := range 200_000 {
				// Deletions outnumber puts in the second half, so that the table shrinks.
				del := r.IntN(100) < 30 || i > 100_000 && r.IntN(100) < 60
				switch {
				case del && len(keys) > 0:
					j := r.IntN(len(keys))
					k := keys[j]
					keys[j] = keys[len(keys)-1]
					keys = keys[:len(keys)-1]
					_, had := want[k]
					if got := tb.del(k); got != had {
						t.Fatalf("op %d: del(%d) = %v, want %v", i, k, got, had)
					}
					delete(want, k)
				default:
					k, v := tt.key(r), r.Uint32()
					if _, had := want[k]; !had {
						keys = append(keys, k)
					}
					if r.IntN(2) == 0 {
						tb.put(k, v)
					} else {
						p, added := tb.upsert(k)
						if _, had := want[k]; added == had || !had && *p != 0 {
							t.Fatalf("op %d: upsert(%d) added %v (value %d), had it %v", i, k, added, *p, had)
						}
						*p = v
					}
					want[k] = v
				}
				if i%20_000 == 0 || i == 199_999 {
					if tb.Len() != len(want) {
						t.Fatalf("op %d: %d keys, want %d", i, tb.Len(), len(want))
					}
					for k, v := range want {
						if got, ok := tb.get(k); !ok || got != v {
							t.Fatalf("op %d: get(%d) = %d, %v, want %d", i, k, got, ok, v)
						}
					}
					for range 1000 {
						k := r.Uint64()
						_, put := want[k]
						if _, ok := tb.get(k); ok != put {
							t.Fatalf("op %d: get(%d) found it %v, want %v", i, k, ok, put)
						}
					}
				}
			}
			if n := len(tb.slots); n > 4*tb.Len()+minTableSlots {
				t.Errorf("%d slots for %d keys: the table did not shrink", n, tb.Len())
			}
		})
	}
}

func TestIndexBoundsBlocksInAll(t *testing.T) {
	x := NewIndex(0, 1)
	x.SetMaxTotal(5)
	steps := []struct {
		name   string
		engine string
		ev     *Event
		want   string
	}{
		{"a fills three of five", "a", storedEvent(engineHashes(1, 3), nil, tokensN(0, 3), 1), ""},
		{"b's three do not fit", "b", storedEvent(engineHashes(2, 3), nil, tokensN(0, 3), 1), ReasonIndexFull},
		{"b's two do", "b", storedEvent(engineHashes(2, 2), nil, tokensN(0, 2), 1), ""},
		{"one more does not", "c", storedEvent(engineHashes(3, 1), nil, tokensN(0, 1), 1), ReasonIndexFull},
		{"a's removal makes room", "a", &Event{Kind: BlockRemoved, Hashes: engineHashes(1, 3)[2:]}, ""},
		{"for c's one", "c", storedEvent(engineHashes(3, 1), nil, tokensN(0, 1), 1), ""},
	}
	for _, s := range steps {
		if got := x.Apply(s.engine, s.ev); got != s.want {
			t.Fatalf("%s: Apply = %q, want %q", s.name, got, s.want)
		}
	}
	for engine, want := range map[string]int{"a": 2, "b": 2, "c": 1} {
		if got := matched(x, tokensN(0, 3), engine); got != want {
			t.Errorf("engine %s matches %d tokens, want %d", engine, got, want)
		}
	}
}

// TestMatchAllAgreesWithMatch drives an index with many engines through stores (shared
// prefixes, several media, a second block size), removals, clears and forgets, and checks
// that one walk for all engines tells each what a match of it alone tells.
func TestMatchAllAgreesWithMatch(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	x := NewIndex(0, 4)
	if err := x.SetTierWeights(map[string]float64{"cpu": 0.5, "tier2": 0.1, "disk": 0}); err != nil {
		t.Fatal(err)
	}
	const engines, prefixes = 40, 12
	prefix := make([][]uint32, prefixes)
	for i := range prefix {
		prefix[i] = tokensN(i*10_000, 64)
	}
	media := []string{"GPU", "GPU", "GPU", "CPU", "tier2", "SSD", "tape"}
	// stored remembers what each engine stored, to remove some of it.
	type copyOf struct {
		hashes []uint64
		medium string
	}
	held := make([][]copyOf, engines)
	name := func(e int) string { return fmt.Sprintf("e%02d", e) }
	seq := uint64(0)
	for step := range 3000 {
		e := r.IntN(engines)
		switch op := r.IntN(100); {
		case op < 60:
			p := prefix[r.IntN(prefixes)]
			bs := 4
			if e%10 == 9 && r.IntN(2) == 0 {
				bs = 8 // engines that change their block size: only the latest counts
			}
			n := 1 + r.IntN(len(p)/bs)
			seq++
			hashes := engineHashes(seq*1000+uint64(e), n)
			ev := storedEvent(hashes, nil, p[:n*bs], bs)
			ev.Medium = media[r.IntN(len(media))]
			x.Apply(name(e), ev)
			held[e] = append(held[e], copyOf{hashes, ev.Medium})
		case op < 90 && len(held[e]) > 0:
			c := held[e][r.IntN(len(held[e]))]
			from := r.IntN(len(c.hashes))
			x.Apply(name(e), &Event{Kind: BlockRemoved, Hashes: c.hashes[from : from+1+r.IntN(len(c.hashes)-from)], Medium: c.medium})
		case op < 95:
			x.Apply(name(e), &Event{Kind: AllBlocksCleared})
			held[e] = nil
		default:
			x.Forget(name(e))
			held[e] = nil
		}
		x.Touch(name(e), time.Unix(int64(step), 0))
		if step%100 != 99 {
			continue
		}
		for _, p := range prefix[:4] {
			m := NewMatcher(append(p, 1, 2, 3, 4))
			var all Matches
			x.MatchAll(m, &all)
			holding := 0
			for i := range engines {
				want := x.Match(m, name(i))
				got := all.Of(x.Engine(name(i)))
				if got != want {
					t.Fatalf("step %d, engine %s: MatchAll says %+v, Match %+v", step, name(i), got, want)
				}
				if want.Matched > 0 {
					holding++
				}
			}
			if all.Len() != holding {
				t.Fatalf("step %d: MatchAll found %d engines, %d hold a block", step, all.Len(), holding)
			}
		}
	}
}

func TestEngineHandleOutlivesForgetNotRetain(t *testing.T) {
	x := NewIndex(0, 4)
	prompt := tokensN(0, 8)
	x.Apply("a", storedEvent(engineHashes(1, 2), nil, prompt, 4))
	x.Touch("a", time.Unix(5, 0))
	h := x.Engine("a")
	var all Matches
	x.MatchAll(NewMatcher(prompt), &all)
	if v := all.Of(h); v.Matched != 8 || !v.Last.Equal(time.Unix(5, 0)) {
		t.Fatalf("before: %+v, want 8 tokens matched, last at 5s", v)
	}
	x.Forget("a")
	x.MatchAll(NewMatcher(prompt), &all)
	if v := all.Of(h); v != (View{}) || h.Removed() {
		t.Errorf("after Forget the handle reads %+v (removed %v), want nothing known, the handle still the name's", v, h.Removed())
	}
	x.Retain(func(string) bool { return false })
	if !h.Removed() || x.Engine("a") == h {
		t.Errorf("after Retain dropped a, its old handle is still the name's")
	}
}

func TestMatchAllEndsEachPrefixAtItsOwnGap(t *testing.T) {
	// Block 0 is held by a and b, block 1 by a alone (b removed it), block 2 by b alone:
	// a matches two blocks, b one, though each of blocks 1 and 2 has one holder.
	x := NewIndex(0, 4)
	prompt := tokensN(0, 12)
	ha, hb := engineHashes(1, 3), engineHashes(2, 3)
	x.Apply("a", storedEvent(ha[:2], nil, prompt[:8], 4))
	x.Apply("b", storedEvent(hb, nil, prompt, 4))
	x.Apply("b", &Event{Kind: BlockRemoved, Hashes: hb[1:2]})
	var all Matches
	x.MatchAll(NewMatcher(prompt), &all)
	for engine, want := range map[string]int{"a": 8, "b": 4} {
		if got := all.Of(x.Engine(engine)).Matched; got != want {
			t.Errorf("engine %s matches %d tokens, want %d", engine, got, want)
		}
	}
}

// BenchmarkIndexMatchAll is BenchmarkIndexMatch's request and engines, answered for every
// engine in one walk.
func BenchmarkIndexMatchAll(b *testing.B) {
	x := NewIndex(0, 0)
	const bs = 16
	prompt := tokensN(0, 4096)
	for i := range 8 {
		x.Apply(string(rune('a'+i)), storedEvent(engineHashes(uint64(i), 128), nil, prompt[:128*bs], bs))
	}
	var all Matches
	b.ReportAllocs()
	for b.Loop() {
		x.MatchAll(NewMatcher(prompt), &all)
	}
	if all.Len() != 8 {
		b.Fatalf("%d engines matched, want 8", all.Len())
	}
}

// TestSharedHolderListsKeepEachBlocksHolders has engines store and evict shared prefixes
// whole and in part, on two media, forget and clear, and checks every block's holders
// against what each engine holds, and that the lists blocks share are counted right and
// never handed out again while named.
func TestSharedHolderListsKeepEachBlocksHolders(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	x := NewIndex(0, 4)
	const engines, prefixes = 24, 6
	prefix := make([][]uint32, prefixes)
	for i := range prefix {
		prefix[i] = tokensN(i*10_000, 96)
	}
	media := []string{"GPU", "GPU", "CPU"}
	type copyOf struct {
		hashes []uint64
		keys   []uint64
		medium string
	}
	// model is each engine's copies: the salted hash, its block's key and slot.
	type entry struct {
		key  uint64
		slot int
	}
	model := make([]map[uint64]entry, engines)
	for e := range model {
		model[e] = map[uint64]entry{}
	}
	held := make([][]copyOf, engines)
	name := func(e int) string { return fmt.Sprintf("e%02d", e) }
	seq := uint64(0)
	shared := 0
	for step := range 4000 {
		e := r.IntN(engines)
		switch op := r.IntN(100); {
		case op < 55:
			p := prefix[r.IntN(prefixes)]
			n := 1 + r.IntN(len(p)/4)
			if r.IntN(2) == 0 {
				n = len(p) / 4 // the whole prefix, as most stores are
			}
			seq++
			hashes := engineHashes(seq*1000+uint64(e), n)
			ev := storedEvent(hashes, nil, p[:n*4], 4)
			ev.Medium = media[r.IntN(len(media))]
			x.Apply(name(e), ev)
			keys := Keys(p[:n*4], 4, nil)
			slot, salt := x.tiers.medium(ev.Medium)
			eng := x.Engine(name(e))
			for i, h := range hashes {
				if _, ok := eng.copies.get(h ^ salt); ok {
					model[e][h^salt] = entry{keys[i], slot}
				}
			}
			held[e] = append(held[e], copyOf{hashes, keys, ev.Medium})
		case op < 90 && len(held[e]) > 0:
			c := held[e][r.IntN(len(held[e]))]
			from := r.IntN(len(c.hashes))
			if r.IntN(2) == 0 {
				from = 0 // the whole copy, as an eviction of a prompt's blocks
			}
			hs := c.hashes[from:]
			x.Apply(name(e), &Event{Kind: BlockRemoved, Hashes: hs, Medium: c.medium})
			_, salt := x.tiers.medium(c.medium)
			for _, h := range hs {
				delete(model[e], h^salt)
			}
		case op < 95:
			x.Apply(name(e), &Event{Kind: AllBlocksCleared})
			held[e], model[e] = nil, map[uint64]entry{}
		default:
			x.Forget(name(e))
			held[e], model[e] = nil, map[uint64]entry{}
		}
		if step%50 != 49 {
			continue
		}
		// What every block's holders should be.
		want := map[uint64]map[uint32]uint32{}
		for e := range engines {
			eng := x.Engine(name(e))
			for _, c := range model[e] {
				if want[c.key] == nil {
					want[c.key] = map[uint32]uint32{}
				}
				want[c.key][eng.id] += 1 << (slotBits * c.slot)
			}
		}
		// And every list's namers.
		namers := map[uint32]int{}
		blocks := 0
		x.blocks.each(func(w uint64) {
			blocks++
			if w&listBit != 0 {
				namers[listOff(w)]++
			}
		})
		if blocks != len(want) {
			t.Fatalf("step %d: the index has %d blocks, the engines hold %d", step, blocks, len(want))
		}
		for k, holders := range want {
			w, ok := x.blocks.get(k)
			if !ok {
				t.Fatalf("step %d: block %x is held by %d engines and not in the index", step, k, len(holders))
			}
			var one [1]uint64
			got := x.holders(w, &one)
			if len(got) != len(holders) {
				t.Fatalf("step %d: block %x has %d holders, want %d", step, k, len(got), len(holders))
			}
			for i, h := range got {
				if i > 0 && holderID(got[i-1]) >= holderID(h) {
					t.Fatalf("step %d: block %x's holders are out of order", step, k)
				}
				if holders[holderID(h)] != holderCounts(h) {
					t.Fatalf("step %d: block %x: engine %d counts %x, want %x", step, k, holderID(h), holderCounts(h), holders[holderID(h)])
				}
			}
		}
		for off, n := range namers {
			c, ok := x.refs.get(uint64(off))
			switch {
			case n == 1 && ok:
				t.Fatalf("step %d: list %d is one block's and counted as shared by %d", step, off, c)
			case n > 1 && int(c) != n:
				t.Fatalf("step %d: list %d is named by %d blocks and counted %d", step, off, n, c)
			}
			if n > 1 {
				shared++
			}
		}
		if x.refs.Len() > len(namers) {
			t.Fatalf("step %d: %d lists counted as shared, %d named at all", step, x.refs.Len(), len(namers))
		}
		for class, free := range x.arena.free {
			for _, off := range free {
				if namers[off] > 0 {
					t.Fatalf("step %d: list %d (class %d) is free and named by %d blocks", step, off, class, namers[off])
				}
			}
		}
	}
	if shared == 0 {
		t.Fatal("no list was ever shared: the test exercised nothing it is about")
	}
}
