package kvcache

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

func TestDecodeBatch(t *testing.T) {
	toks := tokensN(100, 32)
	hashBytes := bytes.Repeat([]byte{0xab}, 32)
	tests := []struct {
		name    string
		payload []byte
		want    Batch
	}{
		{name: "array events with the tag first, as vLLM and SGLang send them",
			payload: payload(t, stored([]uint64{1, 2}, nil, toks, 16), removed(1), cleared()),
			want: Batch{Events: []Event{
				{Kind: BlockStored, Hashes: []uint64{1, 2}, Tokens: toks, BlockSize: 16, Medium: "GPU"},
				{Kind: BlockRemoved, Hashes: []uint64{1}, Medium: "GPU"},
				{Kind: AllBlocksCleared},
			}}},
		{name: "an older BlockStored without medium and lora_name, and a parent",
			payload: payload(t, []any{"BlockStored", []uint64{7}, uint64(6), tokensN(0, 16), 16, nil}),
			want:    Batch{Events: []Event{{Kind: BlockStored, Hashes: []uint64{7}, Parent: 6, HasParent: true, Tokens: tokensN(0, 16), BlockSize: 16}}}},
		{name: "a parent of 0 is none, as some publishers write the first block's",
			payload: payload(t, []any{"BlockStored", []uint64{7}, uint64(0), tokensN(0, 16), 16, nil}),
			want:    Batch{Events: []Event{{Kind: BlockStored, Hashes: []uint64{7}, Tokens: tokensN(0, 16), BlockSize: 16}}}},
		{name: "map events with a type key, and a map batch",
			payload: mustMarshal(t, map[string]any{"ts": 1.0, "data_parallel_rank": 2, "events": []any{
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{9}, "parent_block_hash": nil,
					"token_ids": tokensN(0, 16), "block_size": 16, "lora_name": nil, "extra_keys": []any{nil}, "group_idx": 0},
				map[string]any{"block_hashes": []uint64{9}, "type": "BlockRemoved"},
			}}),
			want: Batch{Rank: 2, Events: []Event{
				{Kind: BlockStored, Hashes: []uint64{9}, Tokens: tokensN(0, 16), BlockSize: 16, Extra: []uint64{0}},
				{Kind: BlockRemoved, Hashes: []uint64{9}},
			}}},
		{name: "hashes as bytes fold to 64 bits: 8 bytes as the integer, longer ones hashed",
			payload: payload(t, removed(), []any{"BlockRemoved", []any{[]byte{0, 0, 0, 0, 0, 0, 1, 2}, hashBytes}, nil}),
			want:    Batch{Events: []Event{{Kind: BlockRemoved, Hashes: []uint64{}, Medium: "GPU"}, {Kind: BlockRemoved, Hashes: []uint64{0x0102, foldHash(hashBytes)}}}}},
		{name: "negative integer hashes keep their 64 bits",
			payload: payload(t, []any{"BlockRemoved", []any{int64(-2)}}),
			want:    Batch{Events: []Event{{Kind: BlockRemoved, Hashes: []uint64{^uint64(1)}}}}},
		{name: "an unknown tag is skipped and counted, the rest applies",
			payload: payload(t, []any{"BlockMoved", []any{1, 2, map[string]any{"x": 1}}}, cleared()),
			want:    Batch{Unknown: 1, Events: []Event{{Kind: AllBlocksCleared}}}},
		{name: "token ids that do not fill the blocks are malformed, the rest applies",
			payload: payload(t, stored([]uint64{1, 2}, nil, tokensN(0, 20), 16), stored([]uint64{1, 2, 3}, nil, tokensN(0, 20), 0), cleared()),
			want:    Batch{Malformed: 2, Events: []Event{{Kind: AllBlocksCleared}}}},
		{name: "a LoRA without its name, or a name without extra_keys, is marked missing keys",
			payload: payload(t,
				[]any{"BlockStored", []uint64{1}, nil, tokensN(0, 4), 4, 3, "GPU", nil},
				[]any{"BlockStored", []uint64{2}, nil, tokensN(0, 4), 4, nil, "GPU", "my-adapter"},
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{5}, "token_ids": tokensN(0, 4), "block_size": 4, "lora_name": "a"}),
			want: Batch{Events: []Event{
				{Kind: BlockStored, Hashes: []uint64{1}, Tokens: tokensN(0, 4), BlockSize: 4, Medium: "GPU", MissingKeys: true},
				{Kind: BlockStored, Hashes: []uint64{2}, Tokens: tokensN(0, 4), BlockSize: 4, Medium: "GPU", MissingKeys: true},
				{Kind: BlockStored, Hashes: []uint64{5}, Tokens: tokensN(0, 4), BlockSize: 4, MissingKeys: true},
			}}},
		{name: "extra keys fold per block as a request's identity folds them, whatever the integers' widths",
			payload: payload(t,
				[]any{"BlockStored", []uint64{3, 4}, nil, tokensN(0, 8), 4, nil, "GPU", nil, []any{[]any{"salt"}, nil}},
				[]any{"BlockStored", []uint64{6, 7}, nil, tokensN(0, 8), 4, 1, "GPU", "a", []any{[]any{"a", "salt"}, []any{"a"}}},
				[]any{"BlockStored", []uint64{8}, nil, tokensN(0, 4), 4, nil, "GPU", nil, []any{[]any{[]any{"mm", int8(3)}}}},
				[]any{"BlockStored", []uint64{9}, nil, tokensN(0, 4), 4, nil, "GPU", nil, []any{[]any{[]any{"mm", int64(3)}}}}),
			want: Batch{Events: []Event{
				{Kind: BlockStored, Hashes: []uint64{3, 4}, Tokens: tokensN(0, 8), BlockSize: 4, Medium: "GPU", Extra: []uint64{firstKey(Identity{Salt: "salt"}), 0}},
				{Kind: BlockStored, Hashes: []uint64{6, 7}, Tokens: tokensN(0, 8), BlockSize: 4, Medium: "GPU",
					Extra: []uint64{firstKey(Identity{LoRA: "a", Salt: "salt"}), firstKey(Identity{LoRA: "a"})}},
				{Kind: BlockStored, Hashes: []uint64{8}, Tokens: tokensN(0, 4), BlockSize: 4, Medium: "GPU", Extra: []uint64{mmKey("mm", 3)}},
				{Kind: BlockStored, Hashes: []uint64{9}, Tokens: tokensN(0, 4), BlockSize: 4, Medium: "GPU", Extra: []uint64{mmKey("mm", 3)}},
			}}},
		{name: "a group, its kind and its window, as hybrid models' events give them",
			payload: mustMarshal(t, []any{1.0, []any{
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{1}, "parent_block_hash": nil, "token_ids": tokensN(0, 12),
					"block_size": 4, "lora_name": nil, "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8},
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{2}, "token_ids": tokensN(0, 4), "block_size": 4,
					"group_idx": 2, "kv_cache_spec_kind": "chunked_local_attention"},
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{3}, "token_ids": tokensN(0, 4), "block_size": 4,
					"group_idx": 0, "kv_cache_spec_kind": "full_attention"},
				map[string]any{"type": "BlockStored", "block_hashes": []uint64{3}, "token_ids": tokensN(0, 8), "block_size": 4,
					"kv_cache_spec_kind": "full_attention"},
				map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{1}, "group_idx": 1},
			}, 0}),
			want: Batch{Malformed: 1, Events: []Event{
				{Kind: BlockStored, Hashes: []uint64{1}, Tokens: tokensN(0, 12), BlockSize: 4, Group: 1, Attention: AttentionSlidingWindow, Window: 8},
				{Kind: BlockStored, Hashes: []uint64{2}, Tokens: tokensN(0, 4), BlockSize: 4, Group: 2, Attention: AttentionOther},
				{Kind: BlockStored, Hashes: []uint64{3}, Tokens: tokensN(0, 4), BlockSize: 4},
				{Kind: BlockRemoved, Hashes: []uint64{1}, Group: 1},
			}}},
		{name: "a batch without a rank is rank 0",
			payload: mustMarshal(t, []any{1.0, []any{}}),
			want:    Batch{Events: []Event{}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DecodeBatch(tt.payload)
			if err != nil {
				t.Fatalf("DecodeBatch: %v", err)
			}
			if !equalBatch(got, tt.want) {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func equalBatch(a, b Batch) bool {
	if a.Rank != b.Rank || a.Unknown != b.Unknown || a.Malformed != b.Malformed || len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		x, y := a.Events[i], b.Events[i]
		if x.Kind != y.Kind || x.Parent != y.Parent || x.HasParent != y.HasParent || x.BlockSize != y.BlockSize ||
			x.Medium != y.Medium || x.MissingKeys != y.MissingKeys || len(x.Hashes) != len(y.Hashes) || len(x.Tokens) != len(y.Tokens) ||
			!slices.Equal(x.Extra, y.Extra) || (x.Extra == nil) != (y.Extra == nil) || x.Group != y.Group || x.Attention != y.Attention || x.Window != y.Window {
			return false
		}
		for j := range x.Hashes {
			if x.Hashes[j] != y.Hashes[j] {
				return false
			}
		}
		for j := range x.Tokens {
			if x.Tokens[j] != y.Tokens[j] {
				return false
			}
		}
	}
	return true
}

func TestDecodeMessageDropsWhatIsNoBatch(t *testing.T) {
	good := payload(t, cleared())
	deep := bytes.Repeat([]byte{0x91}, 10000) // [[[[...
	tests := []struct {
		name   string
		frames [][]byte
		reason string
	}{
		{name: "two frames", frames: [][]byte{[]byte("t"), seqBytes(1)}, reason: ReasonFrames},
		{name: "a sequence of 4 bytes", frames: [][]byte{[]byte("t"), {0, 0, 0, 1}, good}, reason: ReasonFrames},
		{name: "an empty payload", frames: [][]byte{nil, seqBytes(1), nil}, reason: ReasonDecode},
		{name: "a payload that is a string", frames: [][]byte{nil, seqBytes(1), mustMarshal(t, "hello")}, reason: ReasonDecode},
		{name: "events that are a number", frames: [][]byte{nil, seqBytes(1), mustMarshal(t, []any{1.0, 5})}, reason: ReasonDecode},
		{name: "an array claiming 2^32-1 events in a few bytes", frames: [][]byte{nil, seqBytes(1), {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}}, reason: ReasonDecode},
		{name: "block hashes claiming a million entries", frames: [][]byte{nil, seqBytes(1), append(mustMarshal(t, []any{1.0})[:0:0], 0x92, 0x01, 0x91, 0x93, 0xab, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd', 0xdd, 0x00, 0x10, 0x00, 0x00)}, reason: ReasonDecode},
		{name: "values nested ten thousand deep", frames: [][]byte{nil, seqBytes(1), append([]byte{0x92, 0x01, 0x91, 0x92, 0xa1, 'X'}, deep...)}, reason: ReasonDecode},
		{name: "a token id that is a string", frames: [][]byte{nil, seqBytes(1), payload(t, []any{"BlockStored", []uint64{1}, nil, []any{"a"}, 1, nil})}, reason: ReasonDecode},
		{name: "a negative token id", frames: [][]byte{nil, seqBytes(1), payload(t, []any{"BlockStored", []uint64{1}, nil, []any{-1}, 1, nil})}, reason: ReasonDecode},
		{name: "a hash that is a float", frames: [][]byte{nil, seqBytes(1), payload(t, []any{"BlockRemoved", []any{1.5}})}, reason: ReasonDecode},
		{name: "trailing bytes", frames: [][]byte{nil, seqBytes(1), append(good, 0x01)}, reason: ReasonDecode},
		{name: "a string claiming more bytes than there are", frames: [][]byte{nil, seqBytes(1), {0x92, 0x01, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}}, reason: ReasonDecode},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeMessage(tt.frames)
			var de *DecodeError
			if !errors.As(err, &de) || de.Reason != tt.reason {
				t.Fatalf("DecodeMessage error = %v, want a DecodeError with reason %q", err, tt.reason)
			}
		})
	}
}

func TestDecodeMessageReadsTopicAndSequence(t *testing.T) {
	m, err := DecodeMessage([][]byte{[]byte("kv@10.0.0.1:8000@m"), seqBytes(1 << 40), payload(t)})
	if err != nil {
		t.Fatal(err)
	}
	if m.Topic != "kv@10.0.0.1:8000@m" || m.Seq != 1<<40 {
		t.Errorf("got topic %q seq %d", m.Topic, m.Seq)
	}
}

func FuzzDecodeMessage(f *testing.F) {
	f.Add(payload(f, stored([]uint64{1, 2}, nil, tokensN(0, 32), 16), removed(1), cleared()))
	f.Add(payload(f, []any{"BlockStored", []any{[]byte("abcdefghij")}, []byte("x"), tokensN(0, 4), 4, 1, nil, "lora"}))
	f.Add(mustMarshal(f, map[string]any{"ts": 1, "events": []any{map[string]any{"type": "BlockRemoved", "block_hashes": []int{1}}}}))
	f.Add([]byte{0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, p []byte) {
		m, err := DecodeMessage([][]byte{[]byte("topic"), seqBytes(1), p})
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("error %v is no DecodeError", err)
			}
			return
		}
		if len(m.Batch.Events) > maxEvents {
			t.Fatalf("%d events, over the limit", len(m.Batch.Events))
		}
		idx := NewIndex(1000, 0)
		for i := range m.Batch.Events {
			ev := &m.Batch.Events[i]
			if ev.Kind == BlockStored && ev.BlockSize > 0 && len(ev.Tokens) != len(ev.Hashes)*ev.BlockSize &&
				(ev.Attention == AttentionFull || len(ev.Tokens)%ev.BlockSize != 0 || len(ev.Hashes) > len(ev.Tokens)/ev.BlockSize) {
				t.Fatalf("a stored event with %d tokens for %d blocks of %d passed", len(ev.Tokens), len(ev.Hashes), ev.BlockSize)
			}
			idx.Apply("e", ev) // must not panic whatever passed
		}
		// Whatever decodes must encode back, as an engine would, to something that decodes
		// the same.
		again, err := DecodeBatch(encodeBatch(t, m.Batch))
		if err != nil {
			t.Fatalf("the re-encoding of %+v does not decode: %v", m.Batch, err)
		}
		if !sameBatchBut(again, Batch{Events: m.Batch.Events, Rank: m.Batch.Rank}, false) {
			t.Fatalf("decoded %+v, re-encoded and decoded %+v", m.Batch, again)
		}
	})
}

// encodeBatch encodes b as vLLM does, in array form: what it decoded from, less the events it
// skipped and the fields it does not keep. A block's extra keys, which the decoder keeps
// folded, are encoded as a tuple of their fold: as many, and nil where there were none.
func encodeBatch(t *testing.T, b Batch) []byte {
	t.Helper()
	kinds := map[AttentionKind]any{AttentionFull: nil, AttentionSlidingWindow: "sliding_window", AttentionMamba: "mamba", AttentionOther: "unknown"}
	events := make([]any, 0, len(b.Events))
	for _, ev := range b.Events {
		switch ev.Kind {
		case BlockStored:
			var parent, lora, extra, window any
			if ev.HasParent {
				parent = ev.Parent
			}
			if ev.MissingKeys {
				lora = 1
			}
			if ev.Extra != nil {
				keys := make([]any, len(ev.Extra))
				for i, k := range ev.Extra {
					if k != 0 {
						keys[i] = []any{k}
					}
				}
				extra = keys
			}
			if ev.Window != 0 {
				window = ev.Window
			}
			events = append(events, []any{"BlockStored", ev.Hashes, parent, ev.Tokens, ev.BlockSize, lora, ev.Medium, nil, extra,
				ev.Group, kinds[ev.Attention], window})
		case BlockRemoved:
			events = append(events, []any{"BlockRemoved", ev.Hashes, ev.Medium, ev.Group})
		case AllBlocksCleared:
			events = append(events, cleared())
		default:
			t.Fatalf("an event of kind %v decoded", ev.Kind)
		}
	}
	return mustMarshal(t, []any{1733000000.5, events, b.Rank})
}

// sameBatch compares two batches' events field by field, an empty list like none.
func sameBatch(a, b Batch) bool { return sameBatchBut(a, b, true) }

// sameBatchBut is sameBatch, comparing the extra keys' folds only when extraValues is set
// (else whether each block has any).
func sameBatchBut(a, b Batch, extraValues bool) bool {
	if a.Rank != b.Rank || a.Unknown != b.Unknown || a.Malformed != b.Malformed || len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		x, y := a.Events[i], b.Events[i]
		if x.Kind != y.Kind || !slices.Equal(x.Hashes, y.Hashes) || x.HasParent != y.HasParent || x.Parent != y.Parent ||
			!slices.Equal(x.Tokens, y.Tokens) || x.BlockSize != y.BlockSize || x.Medium != y.Medium || x.MissingKeys != y.MissingKeys ||
			(x.Extra == nil) != (y.Extra == nil) || len(x.Extra) != len(y.Extra) || x.Group != y.Group || x.Attention != y.Attention || x.Window != y.Window {
			return false
		}
		for j := range x.Extra {
			if extraValues && x.Extra[j] != y.Extra[j] || (x.Extra[j] == 0) != (y.Extra[j] == 0) {
				return false
			}
		}
	}
	return true
}

// firstKey is the fold of the first block's extra keys of a request of id.
func firstKey(id Identity) uint64 {
	first, _ := id.extraKeys()
	return first
}

// mmKey is the fold of a block's extra keys of one multimodal item at offset.
func mmKey(identifier string, offset int) uint64 {
	var c canon
	c.array(1)
	c.array(2)
	c.str(identifier)
	c.integer(uint64(offset))
	return c.sum()
}

// BenchmarkDecodeAndApply measures one typical message: a request's 64 new blocks (1024
// tokens) stored and 64 older ones removed, decoded and applied to the index.
func BenchmarkDecodeAndApply(b *testing.B) {
	idx := NewIndex(0, 16)
	frames := make([][][]byte, 0, 1024)
	for i := range 1024 {
		h := engineHashes(uint64(i), 64)
		frames = append(frames, [][]byte{[]byte("kv@10.0.0.1:8000@m"), seqBytes(uint64(i)),
			payload(b, stored(h, nil, tokensN(i*1024, 1024), 16), removed(engineHashes(uint64(i+1000), 64)...))})
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		m, err := DecodeMessage(frames[i%len(frames)])
		if err != nil {
			b.Fatal(err)
		}
		for j := range m.Batch.Events {
			idx.Apply("e", &m.Batch.Events[j])
		}
		if i%len(frames) == len(frames)-1 {
			idx.Forget("e")
		}
		i++
	}
}
