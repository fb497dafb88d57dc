package kvcache

import (
	"slices"
	"testing"
)

// keyedEvent is a BlockStored of tokens in blocks of bs, the first of them block first of
// a request of id, with the extra keys vLLM hashes such a request's blocks with.
func keyedEvent(hashes []uint64, parent *uint64, tokens []uint32, bs, first int, id Identity) *Event {
	e := storedEvent(hashes, parent, tokens, bs)
	f, rest := id.extraKeys()
	e.Extra = make([]uint64, len(hashes))
	for i := range e.Extra {
		e.Extra[i] = rest
		if first+i == 0 {
			e.Extra[i] = f
		}
	}
	return e
}

// matchedFor is how many tokens of a request of id engine holds, by Match and by MatchAll,
// which must agree.
func matchedFor(t *testing.T, x *Index, tokens []uint32, id Identity, engine string) int {
	t.Helper()
	one := x.Match(NewMatcherFor(tokens, id), engine).Matched
	var m Matcher
	m.ResetFor(tokens, id)
	var r Matches
	x.MatchAll(&m, &r)
	if all := r.Of(x.Engine(engine)).Matched; all != one {
		t.Fatalf("MatchAll says %d tokens of %s, Match %d", all, engine, one)
	}
	return one
}

func TestIndexMatchesOnlyTheIdentityTheBlocksWereStoredUnder(t *testing.T) {
	const bs = 4
	prompt := tokensN(0, 16)
	base, loraA, loraB := Identity{}, Identity{LoRA: "a"}, Identity{LoRA: "b"}
	salt1, salt2 := Identity{Salt: "tenant-1"}, Identity{Salt: "tenant-2"}
	loraSalted := Identity{LoRA: "a", Salt: "tenant-1"}
	h := engineHashes(1, 4)
	tests := []struct {
		name   string
		stored Identity
		want   map[Identity]int
	}{
		{name: "the base model's blocks match no adapter's request",
			stored: base, want: map[Identity]int{base: 16, loraA: 0, salt1: 0, loraSalted: 0}},
		{name: "an adapter's blocks match its requests only",
			stored: loraA, want: map[Identity]int{loraA: 16, base: 0, loraB: 0, loraSalted: 0}},
		{name: "a salted prompt matches its salt only, not another tenant's nor an unsalted request",
			stored: salt1, want: map[Identity]int{salt1: 16, salt2: 0, base: 0, loraSalted: 0}},
		{name: "an adapter's salted prompt needs both",
			stored: loraSalted, want: map[Identity]int{loraSalted: 16, loraA: 0, salt1: 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(0, bs)
			if why := x.Apply("e", keyedEvent(h, nil, prompt, bs, 0, tt.stored)); why != "" {
				t.Fatalf("Apply = %q", why)
			}
			for id, want := range tt.want {
				if got := matchedFor(t, x, append(slices.Clone(prompt), 90, 91, 92, 93, 94), id, "e"); got != want {
					t.Errorf("a request of %+v matched %d tokens, want %d", id, got, want)
				}
			}
		})
	}
}

func TestIndexChainsASaltThroughTheParentToLaterEvents(t *testing.T) {
	// The salt is in the first block's extra keys only; the blocks a later event stores
	// after it inherit it through their parent.
	const bs = 4
	prompt := tokensN(0, 16)
	h := engineHashes(1, 4)
	id := Identity{LoRA: "a", Salt: "s"}
	x := NewIndex(0, bs)
	if why := x.Apply("e", keyedEvent(h[:1], nil, prompt[:4], bs, 0, id)); why != "" {
		t.Fatal(why)
	}
	if why := x.Apply("e", keyedEvent(h[1:], &h[0], prompt[4:], bs, 1, id)); why != "" {
		t.Fatal(why)
	}
	if got := matchedFor(t, x, prompt, id, "e"); got != 16 {
		t.Errorf("matched %d tokens, want 16", got)
	}
	if got := matchedFor(t, x, prompt, Identity{LoRA: "a", Salt: "other"}, "e"); got != 0 {
		t.Errorf("another salt matched %d tokens, want 0", got)
	}
}

func TestIndexKeepsEachGroupsCopies(t *testing.T) {
	// vLLM hashes a block alike in every group: a sliding-window group's eviction of a
	// block must leave the full-attention group's copy of the same hash.
	const bs = 4
	prompt := tokensN(0, 16)
	h := engineHashes(1, 4)
	x := NewIndex(0, bs)
	full := storedEvent(h, nil, prompt, bs)
	window := storedEvent(h, nil, prompt, bs)
	window.Group, window.Attention, window.Window = 1, AttentionSlidingWindow, 8
	for _, ev := range []*Event{full, window, {Kind: BlockRemoved, Hashes: h[:2], Group: 1}} {
		if why := x.Apply("e", ev); why != "" {
			t.Fatal(why)
		}
	}
	if s, _ := x.Stats("e"); s.Blocks != 6 {
		t.Errorf("the engine holds %d blocks, want 6: 4 of group 0, 2 of group 1", s.Blocks)
	}
	if got := matchedFor(t, x, prompt, Identity{}, "e"); got != 16 {
		t.Errorf("matched %d tokens, want 16: the window still holds the blocks before the end", got)
	}
}

func TestIndexCreditsAHybridModelOnlyWhatItsWindowsReach(t *testing.T) {
	// Blocks of 4 tokens, a window of 8 tokens: a prefix is reused only where the window's
	// group holds the cdiv(8-1, 4) = 2 blocks before its end (vLLM's SlidingWindowManager).
	const bs = 4
	prompt := tokensN(0, 24) // six blocks
	h := engineHashes(1, 6)
	shares4 := append(slices.Clone(prompt[:16]), tokensN(1000, 8)...) // the first four blocks, then others
	longer := append(slices.Clone(prompt), tokensN(2000, 8)...)
	// windowed stores the window's blocks as vLLM with a KV connector does: the blocks out
	// of the window are null and left out, the token ids span them all.
	windowed := func(kind AttentionKind, window int, hashes []uint64) *Event {
		ev := storedEvent(hashes, nil, prompt, bs)
		ev.Group, ev.Attention, ev.Window = 1, kind, window
		return ev
	}
	tests := []struct {
		name  string
		steps []*Event
		want  map[string]int // query -> tokens
	}{
		{name: "a prompt the window holds the end of is reused whole, and so is its continuation",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionSlidingWindow, 8, h[4:])},
			want:  map[string]int{"prompt": 24, "longer": 24, "shares4": 0}},
		{name: "a window that lost its last block reuses nothing",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionSlidingWindow, 8, h[4:]), {Kind: BlockRemoved, Hashes: h[5:], Group: 1}},
			want:  map[string]int{"prompt": 0, "longer": 0}},
		{name: "a window that holds every block reuses any prefix",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionSlidingWindow, 8, h)},
			want:  map[string]int{"prompt": 24, "shares4": 16}},
		{name: "blocks freed out of the window and evicted end the prefixes that need them",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionSlidingWindow, 8, h), {Kind: BlockRemoved, Hashes: h[1:4], Group: 1}},
			want:  map[string]int{"prompt": 24, "shares4": 4}},
		{name: "a Mamba group needs the state of the prefix's last block",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionMamba, 0, h[5:])},
			want:  map[string]int{"prompt": 24, "shares4": 0}},
		{name: "a group of a kind the index cannot weigh credits nothing",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionOther, 0, h)},
			want:  map[string]int{"prompt": 0}},
		{name: "a sliding window whose size the events do not give credits nothing",
			steps: []*Event{storedEvent(h, nil, prompt, bs), windowed(AttentionSlidingWindow, 0, h)},
			want:  map[string]int{"prompt": 0}},
	}
	queries := map[string][]uint32{"prompt": prompt, "longer": longer, "shares4": shares4}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(0, bs)
			x.Apply("plain", storedEvent(engineHashes(9, 6), nil, prompt, bs))
			for i, ev := range tt.steps {
				if why := x.Apply("hybrid", ev); why != "" {
					t.Fatalf("step %d: Apply = %q", i, why)
				}
			}
			for q, want := range tt.want {
				if got := matchedFor(t, x, queries[q], Identity{}, "hybrid"); got != want {
					t.Errorf("%s: the hybrid engine matched %d tokens, want %d", q, got, want)
				}
				if got := matchedFor(t, x, queries[q], Identity{}, "plain"); got != min(len(queries[q]), 24) && q != "shares4" {
					t.Errorf("%s: an engine of one group matched %d tokens", q, got)
				}
			}
		})
	}
}

func TestIndexWindowBlocksWithoutTheirFullAttentionCopiesAreNotPlaced(t *testing.T) {
	const bs = 4
	h := engineHashes(1, 6)
	ev := storedEvent(h[4:], nil, tokensN(0, 24), bs)
	ev.Group, ev.Attention, ev.Window = 1, AttentionSlidingWindow, 8
	x := NewIndex(0, bs)
	if why := x.Apply("e", ev); why != ReasonUnknownParent {
		t.Errorf("Apply = %q, want %q: where the skipped blocks' window blocks are, nothing says", why, ReasonUnknownParent)
	}
}
