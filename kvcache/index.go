package kvcache

import (
	"encoding/binary"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
)

// DefaultMaxBlocks bounds how many blocks the index keeps per engine when its owner gives
// no bound: 16M tokens in 16-token blocks, far above what one engine's GPU holds (an 80 GB
// card holds about 30 thousand blocks of an 8B model's KV), offloaded copies included; and
// what a hostile publisher can make it keep, about 100 MB.
const DefaultMaxBlocks = 1 << 20

// Reasons an event is not applied, as the metrics' reason label has them.
const (
	// ReasonUnknownParent: the blocks continue a block the index does not know (it joined
	// after the parent was stored, or forgot it after a gap), so their place is unknown.
	ReasonUnknownParent = "unknown_parent"
	// ReasonIndexFull: the engine already has the most blocks the index keeps per engine.
	ReasonIndexFull = "index_full"
	// ReasonMalformed: the stored token ids do not fill the blocks.
	ReasonMalformed = "malformed"
	// ReasonExtraKeys: the engine hashed the blocks with more than their tokens (a LoRA, a
	// cache_salt, multimodal inputs); indexed by tokens alone they would draw requests whose
	// tokens match but whose KV differs.
	ReasonExtraKeys = "extra_keys"
)

// DefaultBlockSize is the block size of events that give none when the index's owner gives
// none: vLLM's default.
const DefaultBlockSize = 16

// Index is the precise view: which engine holds which block, from the engines' KV events.
// A block's key is the index's own chained hash of its tokens (the key of the block before
// it, then its block_size token ids), so that any engine's block for the same tokens has
// the same key whatever hash the engine uses, and a request's tokens hash once for all.
// Its methods are safe for concurrent use.
type Index struct {
	maxBlocks int
	blockSize int

	mu      sync.RWMutex
	engines map[string]*engineBlocks
	tiers   tierTable
}

type engineBlocks struct {
	// keys counts the engine's blocks under each key, per tier (8 bits of it per slot of
	// the index's tierTable): the same tokens stored on two media are two blocks, and one
	// removal must leave the other; a block removed from the GPU but stored on CPU is not
	// forgotten. A key is in it while any tier's count is above zero.
	keys map[uint64]uint64
	// byHash maps the engine's own hash (salted by medium) to the key, for BlockRemoved
	// and for the parents of later BlockStored.
	byHash map[uint64]uint64
	// blockSize is the block size of the engine's latest BlockStored; requests are hashed
	// in blocks of it.
	blockSize int
	// last is when the engine's latest message arrived.
	last time.Time
	// bySlot counts the engine's blocks per tier, and untiered those on a medium of none.
	bySlot   [numSlots]int32
	untiered int32
}

// NewIndex returns an empty index that keeps at most maxBlocks blocks per engine, taking
// blockSize for the block size of events that give none (zero or negative: DefaultMaxBlocks
// and DefaultBlockSize).
func NewIndex(maxBlocks, blockSize int) *Index {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	return &Index{maxBlocks: maxBlocks, blockSize: blockSize, engines: make(map[string]*engineBlocks), tiers: defaultTiers()}
}

func (x *Index) engineLocked(engine string) *engineBlocks {
	e := x.engines[engine]
	if e == nil {
		e = &engineBlocks{keys: make(map[uint64]uint64), byHash: make(map[uint64]uint64)}
		x.engines[engine] = e
	}
	return e
}

// rootKey starts every chain; the block size is in it so that chains of different sizes
// never share keys.
func rootKey(blockSize int) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(blockSize))
	return xxhash.Sum64(b[:])
}

// chainKey is the key of the block of tokens after the block keyed parent.
func chainKey(d *xxhash.Digest, parent uint64, tokens []uint32) uint64 {
	var buf [256]byte
	d.Reset()
	binary.LittleEndian.PutUint64(buf[:8], parent)
	n := 8
	for _, t := range tokens {
		if n+4 > len(buf) {
			_, _ = d.Write(buf[:n])
			n = 0
		}
		binary.LittleEndian.PutUint32(buf[n:], t)
		n += 4
	}
	_, _ = d.Write(buf[:n])
	return d.Sum64()
}

// Keys appends to out the index's keys of tokens' full blocks of blockSize tokens.
func Keys(tokens []uint32, blockSize int, out []uint64) []uint64 {
	if blockSize <= 0 {
		return out
	}
	d := xxhash.New()
	k := rootKey(blockSize)
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		k = chainKey(d, k, tokens[i:i+blockSize])
		out = append(out, k)
	}
	return out
}

// Apply applies one event of engine's. It returns "" when applied, or the reason it was
// not (ReasonUnknownParent, ReasonIndexFull, ReasonMalformed, ReasonExtraKeys).
// AllBlocksCleared forgets the engine.
func (x *Index) Apply(engine string, ev *Event) string {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch ev.Kind {
	case AllBlocksCleared:
		delete(x.engines, engine)
	case BlockRemoved:
		e := x.engines[engine]
		if e == nil {
			return ""
		}
		slot, salt := x.tiers.medium(ev.Medium)
		for _, h := range ev.Hashes {
			k, ok := e.byHash[h^salt]
			if !ok {
				continue // stored before the index joined, or already forgotten
			}
			delete(e.byHash, h^salt)
			e.remove(k, slot)
		}
	case BlockStored:
		bs := ev.BlockSize
		if bs == 0 {
			bs = x.blockSize
		}
		if len(ev.Tokens) != len(ev.Hashes)*bs {
			return ReasonMalformed
		}
		if ev.Keyed {
			return ReasonExtraKeys
		}
		e := x.engineLocked(engine)
		slot, salt := x.tiers.medium(ev.Medium)
		parent := rootKey(bs)
		if ev.HasParent {
			p, ok := e.byHash[ev.Parent^salt]
			if !ok {
				// vLLM publishes a block's parent before it; SGLang's parent may be on
				// another medium, and a block offloaded to disk may continue one kept on
				// CPU. Either way a known parent has this engine's tokens.
				p, ok = e.byHash[ev.Parent]
			}
			if !ok {
				p, ok = e.byHash[ev.Parent^cpuSalt]
			}
			if !ok {
				return ReasonUnknownParent
			}
			parent = p
		}
		if len(e.byHash)+len(ev.Hashes) > x.maxBlocks {
			return ReasonIndexFull
		}
		e.blockSize = bs
		d := xxhash.New()
		for i, h := range ev.Hashes {
			parent = chainKey(d, parent, ev.Tokens[i*bs:(i+1)*bs])
			if _, dup := e.byHash[h^salt]; dup {
				continue // stored again without a removal: still one block
			}
			if !e.add(parent, slot) {
				continue
			}
			e.byHash[h^salt] = parent
		}
	}
	return ""
}

// add counts one more copy of the block keyed k on slot; false when the slot counts as
// many as it can (slotMax), and the copy is not indexed.
func (e *engineBlocks) add(k uint64, slot int) bool {
	if slot == noSlot {
		e.untiered++
		return true
	}
	c := e.keys[k]
	if (c>>(8*slot))&slotMax == slotMax {
		return false
	}
	e.keys[k] = c + 1<<(8*slot)
	e.bySlot[slot]++
	return true
}

// remove counts one copy less of the block keyed k on slot, and forgets k when no tier
// holds it.
func (e *engineBlocks) remove(k uint64, slot int) {
	if slot == noSlot {
		e.untiered--
		return
	}
	c := e.keys[k]
	if (c>>(8*slot))&slotMax == 0 {
		return // added under no slot: only SetTierWeights' first call after an Apply does it
	}
	e.bySlot[slot]--
	if c -= 1 << (8 * slot); c == 0 {
		delete(e.keys, k)
	} else {
		e.keys[k] = c
	}
}

// Touch records that a message of engine's arrived at t, whether or not it changed the
// index: the engine's publisher is alive.
func (x *Index) Touch(engine string, t time.Time) {
	x.mu.Lock()
	x.engineLocked(engine).last = t
	x.mu.Unlock()
}

// Forget drops everything the index knows of engine.
func (x *Index) Forget(engine string) {
	x.mu.Lock()
	delete(x.engines, engine)
	x.mu.Unlock()
}

// Retain forgets every engine for which keep is false.
func (x *Index) Retain(keep func(engine string) bool) {
	x.mu.Lock()
	for name := range x.engines {
		if !keep(name) {
			delete(x.engines, name)
		}
	}
	x.mu.Unlock()
}

// Matcher computes the keys of one request's tokens once per block size, for matching them
// against several engines. Its zero value is not usable; see NewMatcher.
type Matcher struct {
	tokens []uint32
	// sizes and keys are the block sizes hashed so far and their keys; one, nearly always.
	sizes []int
	keys  [][]uint64
}

// NewMatcher returns a matcher of tokens.
func NewMatcher(tokens []uint32) *Matcher { return &Matcher{tokens: tokens} }

func (m *Matcher) keysOf(blockSize int) []uint64 {
	for i, s := range m.sizes {
		if s == blockSize {
			return m.keys[i]
		}
	}
	k := Keys(m.tokens, blockSize, make([]uint64, 0, len(m.tokens)/max(blockSize, 1)))
	m.sizes = append(m.sizes, blockSize)
	m.keys = append(m.keys, k)
	return k
}

// View is what the index knows of one engine for one request.
type View struct {
	// Matched is how many of the request's leading tokens the engine holds, in whole blocks,
	// on any tier of weight above 0: the prefix it continues across tiers, as vLLM loads
	// its GPU hits and then its CPU ones.
	Matched int
	// Weighted is Matched with each block weighed by the best weight among the tiers that
	// hold it, in tokens: how many tokens' recompute the engine's cache saves (a CPU block
	// of 16 tokens at weight 0.75 saves 12).
	Weighted float64
	// GPU, CPU, Disk and Other split Matched by the tier each block is counted on, the
	// one of best weight that holds it (Other: the tiers SetTierWeights names).
	GPU, CPU, Disk, Other int
	// Last is when the engine's latest message arrived; zero if the index never heard
	// from it (or forgot it).
	Last time.Time
}

// Match returns what the index knows of engine for m's tokens.
func (x *Index) Match(m *Matcher, engine string) View {
	x.mu.RLock()
	defer x.mu.RUnlock()
	e := x.engines[engine]
	if e == nil {
		return View{}
	}
	v := View{Last: e.last}
	if e.blockSize == 0 || len(e.keys) == 0 {
		return v
	}
	bs := e.blockSize
	w := &x.tiers.weight
	gpu := 0
	for _, k := range m.keysOf(bs) {
		c := e.keys[k]
		if c&slotMax != 0 {
			gpu += bs // the common case, and the best weight: no other tier to look at
			continue
		}
		best, slot := 0.0, noSlot
		for s := 1; c>>(8*s) != 0; s++ {
			if (c>>(8*s))&slotMax != 0 && w[s] > best {
				best, slot = w[s], s
			}
		}
		if slot == noSlot {
			break
		}
		v.Weighted += best * float64(bs)
		switch slot {
		case slotCPU:
			v.CPU += bs
		case slotDisk:
			v.Disk += bs
		default:
			v.Other += bs
		}
	}
	v.GPU = gpu
	v.Weighted += float64(gpu)
	v.Matched = gpu + v.CPU + v.Disk + v.Other
	return v
}

// EngineStats is what the index holds of one engine.
type EngineStats struct {
	// Blocks is how many blocks the engine holds as the index sees it, on every medium.
	Blocks int `json:"blocks"`
	// BlocksByTier splits Blocks by tier (TierGPU, TierCPU, TierDisk, a named tier, or
	// TierOther for media of none); tiers without blocks are left out.
	BlocksByTier map[string]int `json:"blocks_by_tier,omitempty"`
	// BlockSize is the block size of the engine's latest BlockStored, 0 before any.
	BlockSize int `json:"block_size,omitempty"`
	// Last is when the engine's latest message arrived; zero if never.
	Last time.Time `json:"last_event"`
}

// Stats returns what the index holds of engine; ok is false if nothing.
func (x *Index) Stats(engine string) (s EngineStats, ok bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	e := x.engines[engine]
	if e == nil {
		return EngineStats{}, false
	}
	return x.statsLocked(e), true
}

func (x *Index) statsLocked(e *engineBlocks) EngineStats {
	s := EngineStats{Blocks: len(e.byHash), BlockSize: e.blockSize, Last: e.last}
	for slot, n := range e.bySlot {
		if n > 0 {
			if s.BlocksByTier == nil {
				s.BlocksByTier = make(map[string]int, 2)
			}
			s.BlocksByTier[x.tiers.slotName(slot)] = int(n)
		}
	}
	if e.untiered > 0 {
		if s.BlocksByTier == nil {
			s.BlocksByTier = make(map[string]int, 1)
		}
		s.BlocksByTier[TierOther] = int(e.untiered)
	}
	return s
}

// Engines returns the engines the index holds anything of, with their stats.
func (x *Index) Engines() map[string]EngineStats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := make(map[string]EngineStats, len(x.engines))
	for name, e := range x.engines {
		out[name] = x.statsLocked(e)
	}
	return out
}

// BlockKeys returns up to limit of the keys of engine's blocks, in no order: for showing
// an engine's cache as the proxy sees it, not for matching.
func (x *Index) BlockKeys(engine string, limit int) []uint64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	e := x.engines[engine]
	if e == nil {
		return nil
	}
	out := make([]uint64, 0, min(limit, len(e.keys)))
	for k := range e.keys {
		if len(out) >= limit {
			break
		}
		out = append(out, k)
	}
	return out
}
