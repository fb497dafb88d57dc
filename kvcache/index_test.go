package kvcache

import (
	"maps"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// storedEvent is a BlockStored of tokens in blocks of bs under an engine's hashes.
func storedEvent(hashes []uint64, parent *uint64, tokens []uint32, bs int) *Event {
	e := &Event{Kind: BlockStored, Hashes: hashes, Tokens: tokens, BlockSize: bs}
	if parent != nil {
		e.Parent, e.HasParent = *parent, true
	}
	return e
}

func matched(x *Index, tokens []uint32, engine string) int {
	return x.Match(NewMatcher(tokens), engine).Matched
}

func TestIndex(t *testing.T) {
	const bs = 4
	prompt := tokensN(0, 12) // three blocks
	type step struct {
		engine string
		ev     *Event
		reason string
	}
	ha, hb := engineHashes(1, 3), engineHashes(2, 3)
	tests := []struct {
		name  string
		steps []step
		query []uint32
		want  map[string]int
	}{
		{name: "engines with different hash seeds holding the same tokens match alike",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)}, {engine: "b", ev: storedEvent(hb[:2], nil, prompt[:8], bs)}},
			query: append(prompt, 99, 98, 97, 96, 95), want: map[string]int{"a": 12, "b": 8}},
		{name: "blocks stored in two events chain through the parent hash",
			steps: []step{{engine: "a", ev: storedEvent(ha[:1], nil, prompt[:4], bs)}, {engine: "a", ev: storedEvent(ha[1:], &ha[0], prompt[4:], bs)}},
			query: prompt, want: map[string]int{"a": 12}},
		{name: "a removed middle block ends the match there",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)}, {engine: "a", ev: &Event{Kind: BlockRemoved, Hashes: ha[1:2]}}},
			query: prompt, want: map[string]int{"a": 4}},
		{name: "AllBlocksCleared forgets the engine, not the others",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)}, {engine: "b", ev: storedEvent(hb, nil, prompt, bs)}, {engine: "a", ev: &Event{Kind: AllBlocksCleared}}},
			query: prompt, want: map[string]int{"a": 0, "b": 12}},
		{name: "blocks continuing an unknown parent are not placed",
			steps: []step{{engine: "a", ev: storedEvent(ha[1:], &ha[0], prompt[4:], bs), reason: ReasonUnknownParent}},
			query: prompt, want: map[string]int{"a": 0}},
		{name: "a copy on another medium keeps the block after the GPU copy goes",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)},
				{engine: "a", ev: &Event{Kind: BlockStored, Hashes: ha, Tokens: prompt, BlockSize: bs, Medium: "CPU"}},
				{engine: "a", ev: &Event{Kind: BlockRemoved, Hashes: ha, Medium: "GPU"}}},
			query: prompt, want: map[string]int{"a": 12}},
		{name: "a different prompt matches nothing",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)}},
			query: tokensN(1, 12), want: map[string]int{"a": 0}},
		{name: "an event without a block size takes the index's",
			steps: []step{{engine: "a", ev: storedEvent(ha[:2], nil, prompt[:8], 0)}, {engine: "b", ev: storedEvent(hb[:1], nil, prompt[:5], 0), reason: ReasonMalformed}},
			query: prompt, want: map[string]int{"a": 8, "b": 0}},
		{name: "blocks keyed by more than the event gives are not indexed",
			steps: []step{{engine: "a", ev: &Event{Kind: BlockStored, Hashes: ha, Tokens: prompt, BlockSize: bs, MissingKeys: true}, reason: ReasonExtraKeys}},
			query: prompt, want: map[string]int{"a": 0}},
		{name: "a query shorter than a block matches nothing",
			steps: []step{{engine: "a", ev: storedEvent(ha, nil, prompt, bs)}},
			query: prompt[:3], want: map[string]int{"a": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(0, bs)
			for i, s := range tt.steps {
				if got := x.Apply(s.engine, s.ev); got != s.reason {
					t.Fatalf("step %d: Apply = %q, want %q", i, got, s.reason)
				}
			}
			for e, want := range tt.want {
				if got := matched(x, tt.query, e); got != want {
					t.Errorf("engine %s matched %d tokens, want %d", e, got, want)
				}
			}
		})
	}
}

func TestIndexBoundsBlocksPerEngine(t *testing.T) {
	x := NewIndex(4, 0)
	if got := x.Apply("a", storedEvent(engineHashes(1, 3), nil, tokensN(0, 3), 1)); got != "" {
		t.Fatalf("first store: %q", got)
	}
	if got := x.Apply("a", storedEvent(engineHashes(2, 3), nil, tokensN(100, 3), 1)); got != ReasonIndexFull {
		t.Fatalf("a store past the bound = %q, want %q", got, ReasonIndexFull)
	}
	if s, _ := x.Stats("a"); s.Blocks != 3 {
		t.Errorf("engine holds %d blocks, want 3", s.Blocks)
	}
}

func TestIndexRemovalOfTheLastCopyForgetsTheKey(t *testing.T) {
	x := NewIndex(0, 0)
	h := engineHashes(1, 2)
	x.Apply("a", storedEvent(h, nil, tokensN(0, 8), 4))
	x.Apply("a", &Event{Kind: BlockRemoved, Hashes: h})
	if s, _ := x.Stats("a"); s.Blocks != 0 {
		t.Errorf("after removing every block the engine holds %d", s.Blocks)
	}
	if keys := x.BlockKeys("a", 10); len(keys) != 0 {
		t.Errorf("keys left: %v", keys)
	}
}

func BenchmarkIndexMatch(b *testing.B) {
	x := NewIndex(0, 0)
	const bs = 16
	prompt := tokensN(0, 4096)
	for i := range 8 {
		x.Apply(string(rune('a'+i)), storedEvent(engineHashes(uint64(i), 128), nil, prompt[:128*bs], bs))
	}
	b.ReportAllocs()
	for b.Loop() {
		m := NewMatcher(prompt)
		for i := range 8 {
			x.Match(m, string(rune('a'+i)))
		}
	}
}

func TestIndexTiers(t *testing.T) {
	const bs = 4
	prompt := tokensN(0, 12) // three blocks
	h := engineHashes(1, 3)
	on := func(medium string, hashes []uint64, parent *uint64, tokens []uint32) *Event {
		e := storedEvent(hashes, parent, tokens, bs)
		e.Medium = medium
		return e
	}
	tests := []struct {
		name    string
		weights map[string]float64
		events  []*Event
		want    View
	}{
		{name: "a prompt on GPU weighs its length",
			events: []*Event{on("GPU", h, nil, prompt)},
			want:   View{Matched: 12, Weighted: 12, GPU: 12}},
		{name: "a prompt on CPU is matched and weighs three quarters by default",
			events: []*Event{on("CPU", h, nil, prompt)},
			want:   View{Matched: 12, Weighted: 9, CPU: 12}},
		{name: "a GPU removal of a block stored on CPU too leaves it matched on CPU",
			events: []*Event{on("GPU", h, nil, prompt), on("CPU", h, nil, prompt), {Kind: BlockRemoved, Hashes: h, Medium: "GPU"}},
			want:   View{Matched: 12, Weighted: 9, CPU: 12}},
		{name: "removing the last medium forgets the block",
			events: []*Event{on("GPU", h, nil, prompt), on("CPU", h, nil, prompt), {Kind: BlockRemoved, Hashes: h, Medium: "GPU"}, {Kind: BlockRemoved, Hashes: h[1:], Medium: "cpu"}},
			want:   View{Matched: 4, Weighted: 3, CPU: 4}},
		{name: "a prefix continues from GPU onto CPU and disk",
			events: []*Event{on("GPU", h[:1], nil, prompt[:4]), on("cpu", h[1:2], &h[0], prompt[4:8]), on("LocalDisk", h[2:], &h[1], prompt[8:])},
			want:   View{Matched: 12, Weighted: 4 + 3 + 1, GPU: 4, CPU: 4, Disk: 4}},
		{name: "a block on two tiers counts at the better one",
			events: []*Event{on("SSD", h, nil, prompt), on("CPU", h, nil, prompt)},
			want:   View{Matched: 12, Weighted: 9, CPU: 12}},
		{name: "media are matched without regard to case",
			events: []*Event{on("gpu", h[:1], nil, prompt[:4]), on("Cpu", h[1:2], &h[0], prompt[4:8]), on("disk", h[2:], &h[1], prompt[8:])},
			want:   View{Matched: 12, Weighted: 8, GPU: 4, CPU: 4, Disk: 4}},
		{name: "a tier of weight 0 holds nothing, and ends the prefix",
			weights: map[string]float64{"cpu": 0},
			events:  []*Event{on("GPU", h[:1], nil, prompt[:4]), on("CPU", h[1:], &h[0], prompt[4:])},
			want:    View{Matched: 4, Weighted: 4, GPU: 4}},
		{name: "a medium of no tier holds nothing",
			events: []*Event{on("tape", h, nil, prompt)},
			want:   View{}},
		{name: "a medium named by the weights is a tier of its own",
			weights: map[string]float64{"CPU_TIER2": 0.5},
			events:  []*Event{on("cpu_tier2", h, nil, prompt)},
			want:    View{Matched: 12, Weighted: 6, Other: 12}},
		{name: "blocks continuing a parent on GPU chain from another medium",
			events: []*Event{on("GPU", h[:1], nil, prompt[:4]), on("CPU", h[1:], &h[0], prompt[4:])},
			want:   View{Matched: 12, Weighted: 4 + 6, GPU: 4, CPU: 8}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(0, bs)
			if tt.weights != nil {
				if err := x.SetTierWeights(tt.weights); err != nil {
					t.Fatal(err)
				}
			}
			for i, ev := range tt.events {
				if got := x.Apply("a", ev); got != "" {
					t.Fatalf("event %d: Apply = %q", i, got)
				}
			}
			x.Touch("a", time.Unix(1, 0))
			got := x.Match(NewMatcher(prompt), "a")
			got.Last = time.Time{}
			if got != tt.want {
				t.Errorf("Match = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestIndexStatsCountBlocksByTier(t *testing.T) {
	x := NewIndex(0, 4)
	h := engineHashes(1, 3)
	for _, m := range []string{"GPU", "CPU", "SSD", "tape"} {
		ev := storedEvent(h, nil, tokensN(0, 12), 4)
		ev.Medium = m
		x.Apply("a", ev)
	}
	x.Apply("a", &Event{Kind: BlockRemoved, Hashes: h[:1], Medium: "GPU"})
	s, _ := x.Stats("a")
	want := map[string]int{TierGPU: 2, TierCPU: 3, TierDisk: 3, TierOther: 3}
	if s.Blocks != 11 || !maps.Equal(s.BlocksByTier, want) {
		t.Errorf("Stats = %d blocks by tier %v, want 11 by %v", s.Blocks, s.BlocksByTier, want)
	}
}

func TestIndexSetTierWeights(t *testing.T) {
	tests := []struct {
		name    string
		weights []map[string]float64
		wantErr string
	}{
		{name: "weights in [0, 1] and gpu at 1 are taken", weights: []map[string]float64{{"GPU": 1, "cpu": 0.5, "Disk": 0}}},
		{name: "a weight above 1 is refused", weights: []map[string]float64{{"cpu": 1.5}}, wantErr: "not in [0, 1]"},
		{name: "a negative weight is refused", weights: []map[string]float64{{"disk": -0.1}}, wantErr: "not in [0, 1]"},
		{name: "gpu below 1 is refused", weights: []map[string]float64{{"gpu": 0.9}}, wantErr: "the unit"},
		{name: "a disk medium's name is refused for disk's", weights: []map[string]float64{{"ssd": 0.3}}, wantErr: "set disk"},
		{name: "one tier twice in two cases is refused", weights: []map[string]float64{{"cpu": 0.5, "CPU": 0.6}}, wantErr: "same tier"},
		{name: "too many named tiers are refused", weights: []map[string]float64{{"a": 0, "b": 0, "c": 0, "d": 0, "e": 0, "f": 0}}, wantErr: "at most 5"},
		{name: "later weights may change", weights: []map[string]float64{{"t1": 0.5}, {"T1": 0.2, "cpu": 0.1}}},
		{name: "later tiers may not", weights: []map[string]float64{{"t1": 0.5}, {"t2": 0.5}}, wantErr: "fixed when it was built"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(0, 0)
			var err error
			for _, w := range tt.weights {
				if err = x.SetTierWeights(w); err != nil {
					break
				}
			}
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("SetTierWeights = %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
}

// TestKeysTellEveryTokenAndEveryParentApart changes one bit of one token, or the block
// before, of random blocks: the key must change every time; and half a million random
// chains' keys must all differ.
func TestKeysTellEveryTokenAndEveryParentApart(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	tokens := make([]uint32, 4*16)
	for range 200 {
		for i := range tokens {
			tokens[i] = r.Uint32N(200_000)
		}
		bs := []int{16, 3, 1, 64}[r.IntN(4)]
		want := Keys(tokens, bs, nil)
		i, bit := r.IntN(len(tokens)), r.IntN(32)
		tokens[i] ^= 1 << bit
		got := Keys(tokens, bs, nil)
		tokens[i] ^= 1 << bit
		changed := i / bs // the block holding the token, and every one after it
		for b := range want {
			if b < changed && got[b] != want[b] {
				t.Fatalf("block size %d: a change in block %d changed the key of block %d before it", bs, changed, b)
			}
			if b >= changed && got[b] == want[b] {
				t.Fatalf("block size %d: bit %d of token %d changed, block %d kept its key", bs, bit, i, b)
			}
		}
	}
	seen := make(map[uint64]bool, 500_000)
	parent := rootKey(16)
	for n := range 500_000 {
		for i := range tokens[:16] {
			tokens[i] = r.Uint32N(1000) // a small vocabulary: many blocks alike but for a token
		}
		k := chainKey(parent, tokens[:16])
		if seen[k] {
			t.Fatalf("chain %d: its key repeats an earlier block's", n)
		}
		seen[k] = true
		if r.IntN(4) == 0 {
			parent = rootKey(16)
		} else {
			parent = k
		}
	}
}
