package kvcache

import (
	"encoding/binary"
	"math"

	"github.com/cespare/xxhash/v2"
)

// Identity is what vLLM keys a request's KV blocks by beyond their tokens
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys, hash_block_tokens): the
// LoRA adapter's name, in every block's extra keys, and the request's cache_salt, in the
// first block's (the blocks after it inherit it through the chain of parent hashes). The
// zero Identity is a request of the base model without a salt, whose blocks are keyed by
// their tokens alone.
//
// Multimodal items and prompt embeddings are keyed too, by identifiers the proxy cannot
// derive from a request; such a request is scored as holding nothing by its caller, never
// matched here.
type Identity struct {
	// LoRA is the adapter's name as the engine serves it (vLLM's lora_request.lora_name,
	// the name of --lora-modules name=path); empty for the base model.
	LoRA string
	// Salt is the request's cache_salt; empty for none, as vLLM takes an empty salt.
	Salt string
}

// extraKeys are the folded extra keys of a request's blocks: first is block 0's, rest every
// other block's; 0 where a block has none.
func (id Identity) extraKeys() (first, rest uint64) {
	if id.LoRA != "" {
		var c canon
		c.array(1)
		c.str(id.LoRA)
		rest = c.sum()
	}
	var items []string
	if id.LoRA != "" {
		items = append(items, id.LoRA)
	}
	if id.Salt != "" {
		items = append(items, id.Salt)
	}
	if len(items) == 0 {
		return 0, rest
	}
	// vLLM's order: the LoRA name, the multimodal items, the salt, the prompt embeddings.
	var c canon
	c.array(len(items))
	for _, s := range items {
		c.str(s)
	}
	return c.sum(), rest
}

// mixExtra folds a block's extra keys into its key: 0, none, leaves the key as its tokens
// make it, so that blocks without extra keys match as they always did.
func mixExtra(key, extra uint64) uint64 {
	if extra == 0 {
		return key
	}
	return mum(key^extra^keySeed[1], keySeed[2])
}

// canon hashes msgpack values in one form whatever widths their encoder chose (an integer
// is its 64 bits, a string its bytes and length), so that a block's extra keys decoded
// from an event and the same keys made from a request's Identity fold to the same 64 bits.
type canon struct {
	d    xxhash.Digest
	init bool
	b    [9]byte
}

func (c *canon) start() {
	if !c.init {
		c.d.Reset()
		c.init = true
	}
}

// head writes a tag and a length or value of 8 bytes.
func (c *canon) head(tag byte, v uint64) {
	c.start()
	c.b[0] = tag
	binary.BigEndian.PutUint64(c.b[1:], v)
	_, _ = c.d.Write(c.b[:])
}

func (c *canon) array(n int)      { c.head('a', uint64(n)) }
func (c *canon) mapping(n int)    { c.head('m', uint64(n)) }
func (c *canon) integer(v uint64) { c.head('i', v) }
func (c *canon) float(f float64)  { c.head('f', math.Float64bits(f)) }
func (c *canon) null()            { c.head('n', 0) }
func (c *canon) boolean(v bool) {
	var x uint64
	if v {
		x = 1
	}
	c.head('t', x)
}
func (c *canon) ext(typ int8, p []byte) {
	c.head('x', uint64(uint8(typ))<<32|uint64(len(p)))
	_, _ = c.d.Write(p)
}

func (c *canon) str(s string) {
	c.head('s', uint64(len(s)))
	_, _ = c.d.WriteString(s)
}

func (c *canon) strBytes(p []byte) {
	c.head('s', uint64(len(p)))
	_, _ = c.d.Write(p)
}

func (c *canon) bin(p []byte) {
	c.head('b', uint64(len(p)))
	_, _ = c.d.Write(p)
}

// sum is the hash of what was written, never 0 (which means no extra keys).
func (c *canon) sum() uint64 {
	c.start()
	if s := c.d.Sum64(); s != 0 {
		return s
	}
	return 1
}

// AttentionKind is what kind of layers a KV cache group holds (vLLM's KVCacheSpecKind, the
// kv_cache_spec_kind of its BlockStored events), as far as it decides what of a prompt an
// engine reuses.
type AttentionKind uint8

const (
	// AttentionFull is full attention ("full_attention", "mla_attention",
	// "sink_full_attention"), and a group whose events name no kind, as every engine's did
	// before hybrid models published events: a prefix is reused as far as its blocks are
	// held from the first on.
	AttentionFull AttentionKind = iota
	// AttentionSlidingWindow is a sliding window ("sliding_window", "sliding_window_mla"):
	// a prefix is reused up to an end before which the group holds the blocks its window
	// reaches (vLLM's SlidingWindowManager.find_longest_cache_hit).
	AttentionSlidingWindow
	// AttentionMamba is a Mamba (state space) group ("mamba"): a prefix is reused up to a
	// block whose state the group holds.
	AttentionMamba
	// AttentionOther is any other kind ("chunked_local_attention", "unknown", ...): the
	// index cannot tell what of a prefix the engine reuses, and credits it nothing.
	AttentionOther
)

// attentionOf is the kind kv_cache_spec_kind names; AttentionFull when it names none.
func attentionOf(kind []byte) AttentionKind {
	switch string(kind) {
	case "", "full_attention", "mla_attention", "sink_full_attention":
		return AttentionFull
	case "sliding_window", "sliding_window_mla":
		return AttentionSlidingWindow
	case "mamba":
		return AttentionMamba
	}
	return AttentionOther
}

// kvGroup is one KV cache group of an engine's, as its BlockStored events describe it.
type kvGroup struct {
	idx  int32
	kind AttentionKind
	// window is how many blocks before a prefix's end a sliding-window or Mamba group must
	// hold for the prefix to be reused: vLLM's cdiv(sliding_window - 1, block_size) for a
	// sliding window, one block for Mamba; 0 when the events did not give the window.
	window int
	bs     int
}

// copySalt keeps an engine's copies of the same hash in two groups apart: vLLM hashes a
// block alike in every group (its cache key adds the group id), and a group's BlockRemoved
// must leave the other's copy. Group 0, every engine's before hybrid models, is unsalted.
func copySalt(g int32) uint64 {
	if g == 0 {
		return 0
	}
	return mum(uint64(uint32(g))^keySeed[2], keySeed[0])
}

// tableSalt keeps a group of a kind other than full attention apart from the prefix its
// full-attention groups hold, in the table: its blocks are looked up one by one at the end
// of a prefix, never walked from the first.
func tableSalt(g int32) uint64 {
	return mum((uint64(uint32(g))+1)^keySeed[1], keySeed[0]) | 1<<63
}
