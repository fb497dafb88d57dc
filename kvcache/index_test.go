package kvcache

import (
	"testing"
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
		{name: "blocks keyed by more than their tokens are not indexed",
			steps: []step{{engine: "a", ev: &Event{Kind: BlockStored, Hashes: ha, Tokens: prompt, BlockSize: bs, Keyed: true}, reason: ReasonExtraKeys}},
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
