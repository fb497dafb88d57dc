package kvcache

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/internal/decay"
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
	// ReasonExtraKeys: the engine hashed the blocks with keys the event does not give (a
	// lora_id without a lora_name, a lora_name without extra_keys: Event.MissingKeys);
	// indexed without them they would draw requests whose tokens match but whose KV
	// differs.
	ReasonExtraKeys = "extra_keys"
)

// DefaultBlockSize is the block size of events that give none when the index's owner gives
// none: vLLM's default.
const DefaultBlockSize = 16

// DefaultMaxTotalBlocks bounds how many blocks the index keeps in all, counting a block once
// per engine (and medium) that holds it, when its owner gives no bound: 64Mi, about 3 GiB at
// the 45 bytes a block the index costs (BenchmarkRoutingAtScale), enough for 1,000 engines
// of 64 thousand blocks each.
const DefaultMaxTotalBlocks = 1 << 26

// Index is the precise view: which engine holds which block, from the engines' KV events.
// A block's key is the index's own chained hash of its tokens (the key of the block before
// it, then its block_size token ids), so that any engine's block for the same tokens has
// the same key whatever hash the engine uses, and a request's tokens hash once for all.
//
// It is one table keyed by block, not one per engine: each key holds the engines that hold
// the block, with their copies per tier, so that one walk of a request's keys answers every
// engine's matched prefix at a cost that grows with the engines holding the prompt, never
// with the pool (MatchAll). Each engine keeps only the map from its own hashes to the keys,
// which BlockRemoved and the parents of later BlockStored need. Its methods are safe for
// concurrent use.
type Index struct {
	maxBlocks int
	maxTotal  int
	blockSize int

	mu      sync.RWMutex
	engines map[string]*Engine
	// byID are the engines by id; nil where an id is free (freeIDs).
	byID    []*Engine
	freeIDs []uint32
	// blocks maps a block's key to its holders: a lone holder, or a list in arena.
	blocks table[uint64]
	arena  arena
	// refs counts, by offset, the blocks naming each list that two or more blocks share
	// (wordChange); a list not in it is one block's.
	refs table[uint32]
	// total counts every engine's blocks, a block on two media of one engine twice.
	total int
	// sizes counts the engines by the block size of their latest BlockStored: the sizes
	// MatchAll hashes a request in.
	sizes map[int]int
	tiers tierTable
	// scratch holds the keys of the event being applied; touched keeps what Apply reads
	// ahead (table.touch).
	scratch []uint64
	touched uint64
}

// Engine is one engine as the index knows it, a handle that stays valid while its name is
// in the index (until Retain drops it), across Forget and AllBlocksCleared, so that a caller
// matching many engines looks each up once. Its fields are the index's, under its lock,
// except last, removed and hybrid.
type Engine struct {
	// x, id, last and removed are what a pick reads of every engine: first, in one cache line.
	x  *Index
	id uint32
	// last is when the engine's latest message arrived, in Unix nanoseconds; 0 if never
	// since the index last forgot it.
	last atomic.Int64
	// removed is set when Retain drops the engine: its handle is no longer the name's.
	removed atomic.Bool
	// name is what the index knows the engine by.
	name string
	// copies maps the engine's own hash (salted by medium) to the key, for BlockRemoved and
	// for the parents of later BlockStored. The same tokens stored on two media are two
	// copies, and one removal must leave the other; a block removed from the GPU but
	// stored on CPU is not forgotten.
	copies table[uint64]
	// blockSize is the block size of the engine's latest BlockStored; requests are hashed
	// in blocks of it.
	blockSize int
	// known is set by a message of the engine's, cleared when the index forgets it.
	known bool
	// bySlot counts the engine's blocks per tier, and untiered those on a medium of none.
	bySlot   [numSlots]int32
	untiered int32
	// groups are the KV cache groups the engine's BlockStored events named (group_idx,
	// kv_cache_spec_kind); hybrid is set when one is of a kind other than full attention,
	// whose rule narrows what a match of the full-attention blocks credits (prefixHeld).
	groups []kvGroup
	hybrid atomic.Bool
	// fresh counts the GPU blocks of full attention that BlockStored events added since the
	// last Touch, which folds them into stored.
	fresh int
	// stored is the blocks the engine computed lately (StoredLately).
	stored decay.Count
}

// StoredLately is how many blocks the engine computed lately, as its BlockStored events
// said: each block stored on the GPU counts 1 on the message's arrival, and halves every
// decay.HalfLife. Every replica that reads the engine's events counts alike. A cache cleared
// or forgotten keeps it: the work was done.
func (e *Engine) StoredLately(now time.Time) float64 { return e.stored.Value(now) }

// Hybrid reports whether e has a KV cache group of a kind other than full attention (a
// sliding window, Mamba): what it reuses of a prefix depends on where the prefix ends, so
// that text routed to it, unlike the blocks its events tell, says little of what it holds.
func (e *Engine) Hybrid() bool { return e.hybrid.Load() }

// Removed reports whether the index dropped e (Retain): Index.Engine of its name returns
// another handle from then on.
func (e *Engine) Removed() bool { return e.removed.Load() }

// Index returns the index e belongs to.
func (e *Engine) Index() *Index { return e.x }

// Name returns the name the index knows e by.
func (e *Engine) Name() string { return e.name }

// LastEvent returns when e's latest message arrived; zero if none has since the index last
// forgot it.
func (e *Engine) LastEvent() time.Time { return e.lastTime() }

func (e *Engine) lastTime() time.Time {
	if n := e.last.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// NewIndex returns an empty index that keeps at most maxBlocks blocks per engine, taking
// blockSize for the block size of events that give none (zero or negative: DefaultMaxBlocks
// and DefaultBlockSize). It keeps at most DefaultMaxTotalBlocks in all until SetMaxTotal.
func NewIndex(maxBlocks, blockSize int) *Index {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	return &Index{maxBlocks: maxBlocks, maxTotal: DefaultMaxTotalBlocks, blockSize: blockSize,
		engines: make(map[string]*Engine), sizes: make(map[int]int), tiers: defaultTiers()}
}

// BlockSize is the block size of a BlockStored that names none.
func (x *Index) BlockSize() int { return x.blockSize }

// SetMaxTotal bounds the blocks the index keeps in all, a block counted once per engine
// (and medium) holding it (zero or negative: DefaultMaxTotalBlocks). A BlockStored that
// would take the index past it is not applied (ReasonIndexFull), as one past an engine's
// own bound; the engines' removals make room again. It should come before the first Apply.
func (x *Index) SetMaxTotal(n int) {
	if n <= 0 {
		n = DefaultMaxTotalBlocks
	}
	x.mu.Lock()
	x.maxTotal = n
	x.mu.Unlock()
}

// SetTierWeights sets the tiers' weights: gpu is 1; cpu and disk are weights' or their
// defaults (DefaultCPUWeight, DefaultDiskWeight); any other name is a tier of its own
// for the medium of that name. A block held only on tiers of weight 0, or on a medium of no
// tier, counts as not held. The first call fixes the named tiers, and should come before
// the first Apply; a later one may change every weight, not the names. It returns what
// CheckTierWeights says of weights, or that the names changed, and then changes nothing.
func (x *Index) SetTierWeights(weights map[string]float64) error {
	if err := CheckTierWeights(weights); err != nil {
		return err
	}
	named := NamedTiers(weights)
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.tiers.set {
		if len(named) != len(x.tiers.names) {
			return fmt.Errorf("tiers %v: the index's are %v, fixed when it was built", named, x.namedLocked())
		}
		for _, n := range named {
			if _, ok := x.tiers.names[n]; !ok {
				return fmt.Errorf("tiers %v: the index's are %v, fixed when it was built", named, x.namedLocked())
			}
		}
	}
	t := defaultTiers()
	t.set = true
	t.names = x.tiers.names
	if t.names == nil {
		t.names = make(map[string]int, len(named))
		for i, n := range named {
			t.names[n] = slotDisk + 1 + i
		}
	}
	for name, w := range weights {
		switch lower := strings.ToLower(name); lower {
		case TierGPU:
		case TierCPU:
			t.weight[slotCPU] = w
		case TierDisk:
			t.weight[slotDisk] = w
		default:
			t.weight[t.names[lower]] = w
		}
	}
	x.tiers = t
	return nil
}

func (x *Index) namedLocked() []string {
	out := make([]string, 0, len(x.tiers.names))
	for n := range x.tiers.names {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Engine returns the handle of the engine called name, adding it (knowing nothing of it)
// if the index has none.
func (x *Index) Engine(name string) *Engine {
	x.mu.RLock()
	e := x.engines[name]
	x.mu.RUnlock()
	if e != nil {
		return e
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.handleLocked(name)
}

func (x *Index) handleLocked(name string) *Engine {
	if e := x.engines[name]; e != nil {
		return e
	}
	e := &Engine{x: x, name: name}
	if n := len(x.freeIDs); n > 0 {
		e.id = x.freeIDs[n-1]
		x.freeIDs = x.freeIDs[:n-1]
		x.byID[e.id] = e
	} else {
		e.id = uint32(len(x.byID))
		x.byID = append(x.byID, e)
	}
	x.engines[name] = e
	return e
}

// engineLocked is the engine called name, known from now on.
func (x *Index) engineLocked(name string) *Engine {
	e := x.handleLocked(name)
	e.known = true
	return e
}

// knownLocked is the engine called name if the index knows anything of it, else nil.
func (x *Index) knownLocked(name string) *Engine {
	if e := x.engines[name]; e != nil && e.known {
		return e
	}
	return nil
}

// clearLocked forgets everything of e but its handle.
func (x *Index) clearLocked(e *Engine) {
	e.copies.each(func(k uint64) { x.dropHolder(e, k) })
	x.total -= e.copies.Len()
	e.copies = table[uint64]{}
	x.setBlockSize(e, 0)
	e.bySlot, e.untiered = [numSlots]int32{}, 0
	e.groups = nil
	e.hybrid.Store(false)
	e.known = false
	e.last.Store(0)
}

// setBlockSize makes bs e's block size, as sizes counts it.
func (x *Index) setBlockSize(e *Engine, bs int) {
	if e.blockSize == bs {
		return
	}
	if e.blockSize != 0 {
		if x.sizes[e.blockSize]--; x.sizes[e.blockSize] == 0 {
			delete(x.sizes, e.blockSize)
		}
	}
	if bs != 0 {
		x.sizes[bs]++
	}
	e.blockSize = bs
}

// Apply applies one event of engine's. It returns "" when applied, or the reason it was
// not (ReasonUnknownParent, ReasonIndexFull, ReasonMalformed, ReasonExtraKeys).
// AllBlocksCleared forgets the engine.
//
// A block's key chains its extra keys (Event.Extra) after its tokens, as vLLM's block hash
// does, so that a LoRA's or a salted request's blocks match only requests of the same
// Identity; and a group's blocks are the engine's copies of that group (Event.Group), so
// that a sliding-window group's evictions never take a full-attention block with them.
func (x *Index) Apply(engine string, ev *Event) string {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch ev.Kind {
	case AllBlocksCleared:
		if e := x.knownLocked(engine); e != nil {
			x.clearLocked(e)
		}
	case BlockRemoved:
		e := x.knownLocked(engine)
		if e == nil {
			return ""
		}
		slot, salt := x.tiers.medium(ev.Medium)
		salt ^= copySalt(ev.Group)
		// Each table's slots are read for every block before any is changed, as for
		// BlockStored below.
		var seen uint64
		for _, h := range ev.Hashes {
			seen += e.copies.touch(h ^ salt)
		}
		keys := x.scratch[:0]
		for _, h := range ev.Hashes {
			k, ok := e.copies.get(h ^ salt)
			if !ok {
				continue // stored before the index joined, or already forgotten
			}
			e.copies.del(h ^ salt)
			x.total--
			keys = append(keys, k)
			seen += x.blocks.touch(k)
		}
		x.scratch, x.touched = keys, seen
		var last wordChange
		for _, k := range keys {
			x.removeCopy(e, k, slot, &last)
		}
	case BlockStored:
		return x.storeLocked(engine, ev)
	}
	return ""
}

// storeLocked applies a BlockStored.
func (x *Index) storeLocked(engine string, ev *Event) string {
	bs := ev.BlockSize
	if bs == 0 {
		bs = x.blockSize
	}
	blocks := len(ev.Tokens) / bs
	switch {
	case len(ev.Tokens)%bs != 0 || len(ev.Hashes) > blocks || ev.Extra != nil && len(ev.Extra) != len(ev.Hashes):
		return ReasonMalformed
	case len(ev.Hashes) < blocks && ev.Attention == AttentionFull:
		return ReasonMalformed
	case ev.MissingKeys:
		return ReasonExtraKeys
	}
	e := x.engineLocked(engine)
	x.noteGroup(e, ev, bs)
	if len(ev.Hashes) == 0 {
		return "" // every block out of the group's window: nothing held, but the group is known
	}
	slot, salt := x.tiers.medium(ev.Medium)
	keys := x.scratch[:0]
	if len(ev.Hashes) == blocks {
		parent := rootKey(bs)
		if ev.HasParent {
			p, ok := x.chainKeyOf(e, ev.Parent, salt, ev.Group, true)
			if !ok {
				return ReasonUnknownParent
			}
			parent = p
		}
		for i := range ev.Hashes {
			parent = chainKey(parent, ev.Tokens[i*bs:(i+1)*bs])
			if ev.Extra != nil {
				parent = mixExtra(parent, ev.Extra[i])
			}
			keys = append(keys, parent)
		}
	} else {
		// vLLM left out the blocks its window skips (null blocks): which blocks the hashes
		// are of, it does not say, so each is found by its hash among the engine's
		// full-attention blocks, which hash alike (vLLM's cache key adds the group to the
		// same hash). A block found nowhere is left out.
		found := 0
		for _, h := range ev.Hashes {
			k, ok := x.chainKeyOf(e, h, salt, ev.Group, false)
			if ok {
				found++
			}
			keys = append(keys, k)
		}
		if found == 0 {
			x.scratch = keys
			return ReasonUnknownParent
		}
	}
	if e.copies.Len()+len(ev.Hashes) > x.maxBlocks || x.total+len(ev.Hashes) > x.maxTotal {
		x.scratch = keys
		return ReasonIndexFull
	}
	if ev.Attention == AttentionFull {
		x.setBlockSize(e, bs)
	}
	if ts := tableSaltOf(ev.Group, ev.Attention); ts != 0 {
		for i := range keys {
			keys[i] ^= ts
		}
	}
	salt ^= copySalt(ev.Group)
	// The blocks' keys first, then a read of each block's slots in both tables, then
	// the changes: the reads do not depend on each other, so that their cache misses
	// (two a block once the tables outgrow the caches) overlap, and the changes find
	// the slots cached. The tables grow first, so that what is read stays where it is.
	e.copies.reserve(len(keys))
	if slot != noSlot {
		x.blocks.reserve(len(keys))
	}
	var seen uint64
	for i, h := range ev.Hashes {
		seen += e.copies.touch(h^salt) + x.blocks.touch(keys[i])
	}
	x.scratch, x.touched = keys, seen
	var last wordChange
	unresolved := tableSaltOf(ev.Group, ev.Attention) // the key of a block found nowhere
	for i, h := range ev.Hashes {
		if keys[i] == unresolved && len(ev.Hashes) < blocks {
			continue
		}
		c, added := e.copies.upsert(h ^ salt)
		if !added {
			continue // stored again without a removal: still one block
		}
		*c = keys[i]
		if !x.addCopy(e, keys[i], slot, &last) {
			e.copies.del(h ^ salt)
			continue
		}
		x.total++
		if slot == slotGPU && ev.Attention == AttentionFull {
			e.fresh++
		}
	}
	return ""
}

// tableSaltOf is the table salt of group g of kind a: none for full attention.
func tableSaltOf(g int32, a AttentionKind) uint64 {
	if a == AttentionFull {
		return 0
	}
	return tableSalt(g)
}

// noteGroup records the group ev's blocks are of, with its kind and window.
func (x *Index) noteGroup(e *Engine, ev *Event, bs int) {
	g := kvGroup{idx: ev.Group, kind: ev.Attention, bs: bs}
	switch g.kind {
	case AttentionSlidingWindow:
		if ev.Window > 0 {
			g.window = max(1, (ev.Window-1+bs-1)/bs)
		}
	case AttentionMamba:
		g.window = 1
	}
	i := slices.IndexFunc(e.groups, func(o kvGroup) bool { return o.idx == g.idx })
	switch {
	case i < 0:
		e.groups = append(e.groups, g)
	case e.groups[i] == g:
		return
	default:
		e.groups[i] = g
	}
	e.hybrid.Store(slices.ContainsFunc(e.groups, func(o kvGroup) bool { return o.kind != AttentionFull }))
}

// chainKeyOf returns the key that the block e published under hash h chains to its
// children (its table key without the group's salt): looked up in group g's copies on the
// medium of salt, on the GPU and on CPU (SGLang's parent may be on another medium, and a
// block offloaded to disk may continue one kept on CPU), then in e's full-attention groups'
// (a sliding-window group's parent may be a block out of its window, which it does not
// hold). own is false to skip g's own copies.
func (x *Index) chainKeyOf(e *Engine, h, salt uint64, g int32, own bool) (uint64, bool) {
	try := func(grp kvGroup) (uint64, bool) {
		gs := copySalt(grp.idx)
		for _, ms := range [...]uint64{salt, 0, cpuSalt} {
			if k, ok := e.copies.get(h ^ ms ^ gs); ok {
				return k ^ tableSaltOf(grp.idx, grp.kind), true
			}
		}
		return 0, false
	}
	if own {
		kind := AttentionFull
		if i := slices.IndexFunc(e.groups, func(o kvGroup) bool { return o.idx == g }); i >= 0 {
			kind = e.groups[i].kind
		}
		if k, ok := try(kvGroup{idx: g, kind: kind}); ok {
			return k, true
		}
	}
	if len(e.groups) == 0 && !own {
		return try(kvGroup{})
	}
	for _, grp := range e.groups {
		if grp.kind == AttentionFull && (grp.idx != g || !own) {
			if k, ok := try(grp); ok {
				return k, true
			}
		}
	}
	return 0, false
}

// wordChange is what adding or removing one copy did to a block's holders word: the blocks
// of one event nearly always have the same holders (a prefix that the same engines store
// and evict as a whole), so that the next block whose word is from gets to, the list shared
// (refs), without a list of its own. A list shared is copied before it changes (own).
type wordChange struct {
	from, to uint64
	// set says the change is one; ok is what addCopy returned.
	set, ok bool
}

// reuse gives the word at p the change c made to a word equal to it, and reports whether
// it could: only a change whose result is a list, from a word that was not absent.
func (x *Index) reuse(p *uint64, c *wordChange) bool {
	if !c.set || *p != c.from || c.to&listBit == 0 {
		return false
	}
	x.shareList(c.to)
	x.unshareList(c.from)
	*p = c.to
	return true
}

// shareList counts one more block naming the list w names (nothing if w is a lone holder).
func (x *Index) shareList(w uint64) {
	if w&listBit == 0 {
		return
	}
	if c, added := x.refs.upsert(uint64(listOff(w))); added {
		*c = 2
	} else {
		*c++
	}
}

// unshareList counts one block less naming the list w names, and frees the list when none
// does.
func (x *Index) unshareList(w uint64) {
	if w&listBit == 0 {
		return
	}
	off := uint64(listOff(w))
	switch c := x.refs.ref(off); {
	case c == nil:
		x.arena.release(listOff(w), listClass(w))
	case *c == 2:
		x.refs.del(off)
	default:
		*c--
	}
}

// own makes the list the word at p names the block's own, a copy if other blocks name it
// too, and returns its holders.
func (x *Index) own(p *uint64) []uint64 {
	w := *p
	off, n, class := listOff(w), listLen(w), listClass(w)
	c := x.refs.ref(uint64(off))
	if c == nil {
		return x.arena.list(off, n)
	}
	if *c == 2 {
		x.refs.del(uint64(off))
	} else {
		*c--
	}
	noff := x.arena.alloc(class)
	l := x.arena.list(noff, n)
	copy(l, x.arena.list(off, n))
	*p = listWord(noff, n, class)
	return l
}

// addCopy counts one more copy of the block keyed k on slot for e; false when the slot
// counts as many as it can (slotMax), or the block has as many holders as a list holds,
// and the copy is not indexed. last is the change to the event's block before, and is
// made this one's.
func (x *Index) addCopy(e *Engine, k uint64, slot int, last *wordChange) bool {
	if slot == noSlot {
		e.untiered++
		return true
	}
	p, added := x.blocks.upsert(k)
	if !added && x.reuse(p, last) {
		if last.ok {
			e.bySlot[slot]++
		}
		return last.ok
	}
	from := *p
	ok := x.addTo(p, added, e, slot)
	*last = wordChange{from: from, to: *p, set: !added, ok: ok}
	if ok {
		e.bySlot[slot]++
	}
	return ok
}

// addTo adds one copy on slot for e to the holders word at p (added: a block new to the
// table).
func (x *Index) addTo(p *uint64, added bool, e *Engine, slot int) bool {
	inc := uint64(1) << (slotBits * slot)
	mine := holder(e.id, uint32(inc))
	switch {
	case added:
		*p = mine
	case *p&listBit == 0 && holderID(*p) == e.id:
		if (holderCounts(*p)>>(slotBits*slot))&slotMax == slotMax {
			return false
		}
		*p += inc
	case *p&listBit == 0:
		off := x.arena.alloc(1)
		l := x.arena.list(off, 2)
		l[0], l[1] = *p, mine
		if holderID(*p) > e.id {
			l[0], l[1] = mine, *p
		}
		*p = listWord(off, 2, 1)
	default:
		w := *p
		n, class := listLen(w), listClass(w)
		l := x.arena.list(listOff(w), n)
		i, found := searchHolders(l, e.id)
		if found && (holderCounts(l[i])>>(slotBits*slot))&slotMax == slotMax {
			return false
		}
		if !found && n == 1<<class && class == maxClass {
			return false
		}
		l = x.own(p)
		off := listOff(*p)
		if found {
			l[i] += inc
			break
		}
		if n < 1<<class {
			l = x.arena.list(off, n+1)
			copy(l[i+1:], l[i:n])
			l[i] = mine
			*p = listWord(off, n+1, class)
			break
		}
		noff := x.arena.alloc(class + 1)
		nl := x.arena.list(noff, n+1)
		copy(nl, l[:i])
		nl[i] = mine
		copy(nl[i+1:], l[i:])
		x.arena.release(off, class)
		*p = listWord(noff, n+1, class+1)
	}
	return true
}

// removeCopy counts one copy less of the block keyed k on slot for e, and drops e from the
// block's holders when no tier of e's holds it. last is as for addCopy.
func (x *Index) removeCopy(e *Engine, k uint64, slot int, last *wordChange) {
	if slot == noSlot {
		e.untiered--
		return
	}
	dec := uint64(1) << (slotBits * slot)
	p := x.blocks.ref(k)
	if p == nil {
		return
	}
	if *p&listBit == 0 {
		if holderID(*p) != e.id || (holderCounts(*p)>>(slotBits*slot))&slotMax == 0 {
			return // added under no slot: only SetTierWeights' first call after an Apply does it
		}
		e.bySlot[slot]--
		if *p -= dec; holderCounts(*p) == 0 {
			x.blocks.del(k)
		}
		return
	}
	if x.reuse(p, last) {
		e.bySlot[slot]--
		return
	}
	l := x.arena.list(listOff(*p), listLen(*p))
	i, found := searchHolders(l, e.id)
	if !found || (holderCounts(l[i])>>(slotBits*slot))&slotMax == 0 {
		return
	}
	from := *p
	e.bySlot[slot]--
	l = x.own(p)
	if l[i] -= dec; holderCounts(l[i]) == 0 {
		x.dropAt(p, l, i)
	}
	*last = wordChange{from: from, to: *p, set: true, ok: true}
}

// dropHolder drops e from the holders of the block keyed k, whatever its copies.
func (x *Index) dropHolder(e *Engine, k uint64) {
	p := x.blocks.ref(k)
	switch {
	case p == nil:
	case *p&listBit == 0:
		if holderID(*p) == e.id {
			x.blocks.del(k)
		}
	default:
		l := x.arena.list(listOff(*p), listLen(*p))
		if i, found := searchHolders(l, e.id); found {
			x.dropAt(p, x.own(p), i)
		}
	}
}

// dropAt removes the i-th holder of the list l that the blocks table's word at p names, the
// block's own: a list of one becomes a lone holder, and a list a quarter full moves to a
// smaller one.
func (x *Index) dropAt(p *uint64, l []uint64, i int) {
	off, class, n := listOff(*p), listClass(*p), len(l)
	if n == 2 {
		*p = l[1-i]
		x.arena.release(off, class)
		return
	}
	copy(l[i:], l[i+1:])
	n--
	if class > 1 && n <= 1<<(class-2) {
		noff := x.arena.alloc(class - 1)
		copy(x.arena.list(noff, n), l[:n])
		x.arena.release(off, class)
		*p = listWord(noff, n, class-1)
		return
	}
	*p = listWord(off, n, class)
}

// holders returns the holders a blocks table word names; one keeps a lone holder.
func (x *Index) holders(w uint64, one *[1]uint64) []uint64 {
	if w&listBit == 0 {
		one[0] = w
		return one[:]
	}
	return x.arena.list(listOff(w), listLen(w))
}

// Touch records that a message of engine's arrived at t, whether or not it changed the
// index: the engine's publisher is alive.
func (x *Index) Touch(engine string, t time.Time) {
	x.mu.Lock()
	e := x.engineLocked(engine)
	fresh := e.fresh
	e.fresh = 0
	x.mu.Unlock()
	if fresh > 0 && !t.IsZero() {
		e.stored.Add(t, float64(fresh))
	}
	n := int64(0)
	if !t.IsZero() {
		n = t.UnixNano()
	}
	e.last.Store(n)
}

// Forget drops everything the index knows of engine.
func (x *Index) Forget(engine string) {
	x.mu.Lock()
	if e := x.engines[engine]; e != nil {
		x.clearLocked(e)
	}
	x.mu.Unlock()
}

// Retain forgets every engine for which keep is false, and drops its handle.
func (x *Index) Retain(keep func(engine string) bool) {
	x.mu.Lock()
	for name, e := range x.engines {
		if !keep(name) {
			x.clearLocked(e)
			delete(x.engines, name)
			x.byID[e.id] = nil
			x.freeIDs = append(x.freeIDs, e.id)
			e.removed.Store(true)
		}
	}
	x.mu.Unlock()
}

// Matcher computes the keys of one request's tokens once per block size, for matching them
// against several engines. Its zero value is not usable; see NewMatcher. It is not safe for
// concurrent use.
type Matcher struct {
	tokens []uint32
	// first and rest are the extra keys of the request's first block and of the others
	// (Identity.extraKeys).
	first, rest uint64
	// sizes and keys are the block sizes hashed so far and their keys; one, nearly always.
	sizes []int
	keys  [][]uint64
	// words and alive are MatchAll's scratch.
	words []uint64
	alive []matchAcc
	// touched keeps what matchSize reads ahead, so that the reads are not left out.
	touched uint64
}

// matchRun is how many of a prompt's blocks matchSize reads ahead of looking them up: 16
// misses in flight, and at most 15 blocks read past the prefix held.
const matchRun = 16

// NewMatcher returns a matcher of tokens of a request of the zero Identity: the base
// model, no salt.
func NewMatcher(tokens []uint32) *Matcher { return &Matcher{tokens: tokens} }

// NewMatcherFor returns a matcher of tokens of a request of identity id: only blocks the
// engines stored under the same LoRA and cache_salt match.
func NewMatcherFor(tokens []uint32, id Identity) *Matcher {
	m := &Matcher{tokens: tokens}
	m.first, m.rest = id.extraKeys()
	return m
}

// Reset makes m a matcher of tokens of the zero Identity, keeping the room its earlier
// matches took.
func (m *Matcher) Reset(tokens []uint32) { m.ResetFor(tokens, Identity{}) }

// ResetFor makes m a matcher of tokens of identity id, keeping the room its earlier
// matches took.
func (m *Matcher) ResetFor(tokens []uint32, id Identity) {
	m.tokens, m.sizes = tokens, m.sizes[:0]
	m.first, m.rest = 0, 0
	if id != (Identity{}) {
		m.first, m.rest = id.extraKeys()
	}
	for i := range m.keys {
		m.keys[i] = m.keys[i][:0]
	}
}

// keysOf returns the keys of m's first n blocks of blockSize (all of them if the tokens end
// first), hashing only those not hashed before: a match hashes as far as the prefix held
// goes, not the whole prompt.
func (m *Matcher) keysOf(blockSize, n int) []uint64 {
	if blockSize <= 0 {
		return nil
	}
	i := slices.Index(m.sizes, blockSize)
	if i < 0 {
		i = len(m.sizes)
		m.sizes = append(m.sizes, blockSize)
		if i == len(m.keys) {
			m.keys = append(m.keys, make([]uint64, 0, len(m.tokens)/blockSize))
		}
		m.keys[i] = m.keys[i][:0]
	}
	keys := m.keys[i]
	n = min(n, len(m.tokens)/blockSize)
	if len(keys) < n {
		k := rootKey(blockSize)
		if len(keys) > 0 {
			k = keys[len(keys)-1]
		}
		for j := len(keys); j < n; j++ {
			k = chainKey(k, m.tokens[j*blockSize:(j+1)*blockSize])
			if j == 0 {
				k = mixExtra(k, m.first)
			} else {
				k = mixExtra(k, m.rest)
			}
			keys = append(keys, k)
		}
		m.keys[i] = keys
	}
	return keys[:n]
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

// matchAcc is one engine's match as a walk goes: its blocks off the GPU per tier and their
// weights. Every engine a walk follows holds its first blocks from the first on, so its
// GPU blocks are the rest of those it matched (view).
type matchAcc struct {
	e                *Engine
	id               uint32
	cpu, disk, other int32
	weighted         float64
}

// add counts one more block of bs tokens on slot of weight w.
func (a *matchAcc) add(slot int, w float64, bs int) {
	switch slot {
	case slotGPU:
		return // weighed 1 each at the end, as Match does
	case slotCPU:
		a.cpu++
	case slotDisk:
		a.disk++
	default:
		a.other++
	}
	a.weighted += w * float64(bs)
}

// view is a's View for a match of blocks blocks of bs tokens.
func (a *matchAcc) view(blocks, bs int) View {
	gpu := blocks - int(a.cpu+a.disk+a.other)
	v := View{GPU: gpu * bs, CPU: int(a.cpu) * bs, Disk: int(a.disk) * bs, Other: int(a.other) * bs}
	v.Weighted = a.weighted + float64(v.GPU)
	v.Matched = blocks * bs
	return v
}

// best is the slot of best weight among those counts holds copies on, and its weight;
// noSlot if none of weight above 0.
func (x *Index) best(counts uint32) (int, float64) {
	if counts&slotMax != 0 {
		return slotGPU, 1 // the common case, and the best weight: no other tier to look at
	}
	w := &x.tiers.weight
	best, slot := 0.0, noSlot
	for s := 1; counts>>(slotBits*s) != 0; s++ {
		if (counts>>(slotBits*s))&slotMax != 0 && w[s] > best {
			best, slot = w[s], s
		}
	}
	return slot, best
}

// Match returns what the index knows of engine for m's tokens.
func (x *Index) Match(m *Matcher, engine string) View {
	x.mu.RLock()
	defer x.mu.RUnlock()
	e := x.knownLocked(engine)
	if e == nil {
		return View{}
	}
	v := View{Last: e.lastTime()}
	if e.blockSize == 0 || e.copies.Len() == 0 {
		return v
	}
	av := x.viewLocked(m, e, math.MaxInt)
	if e.hybrid.Load() {
		if n := x.prefixHeld(m, e, av.Matched/e.blockSize); n*e.blockSize < av.Matched {
			av = x.viewLocked(m, e, n)
		}
	}
	av.Last = v.Last
	return av
}

// viewLocked is e's View of m's first limit blocks at most, without Last.
func (x *Index) viewLocked(m *Matcher, e *Engine, limit int) View {
	bs := e.blockSize
	a := matchAcc{e: e, id: e.id}
	var one [1]uint64
	blocks := 0
	for _, k := range m.keysOf(bs, limit) {
		w, ok := x.blocks.get(k)
		if !ok {
			break
		}
		hs := x.holders(w, &one)
		i, found := searchHolders(hs, e.id)
		if !found {
			break
		}
		slot, wt := x.best(holderCounts(hs[i]))
		if slot == noSlot {
			break
		}
		a.add(slot, wt, bs)
		blocks++
	}
	return a.view(blocks, bs)
}

// prefixHeld narrows a match of blocks leading blocks of e's full-attention groups to what
// e reuses of them, as vLLM's hybrid coordinator does (find_longest_cache_hit): every
// sliding-window and Mamba group must hold the blocks its window reaches before the
// prefix's end, each asked in turn until none narrows it further. An engine with a group
// of another kind, of another block size, or whose window its events did not give, is
// credited nothing: better no hit than a false one.
func (x *Index) prefixHeld(m *Matcher, e *Engine, blocks int) int {
	keys := m.keysOf(e.blockSize, blocks)
	for narrowed := true; narrowed && blocks > 0; {
		narrowed = false
		for _, g := range e.groups {
			if g.kind == AttentionFull {
				continue
			}
			if g.kind == AttentionOther || g.bs != e.blockSize || g.window <= 0 {
				return 0
			}
			if n := x.windowHeld(e, g, keys[:blocks]); n < blocks {
				blocks, narrowed = n, true
			}
		}
	}
	return blocks
}

// windowHeld is vLLM's SlidingWindowManager.find_longest_cache_hit over keys: from the
// end back, the first run of g.window blocks that g holds ends the prefix; without one,
// the run from the first block does.
func (x *Index) windowHeld(e *Engine, g kvGroup, keys []uint64) int {
	salt := tableSalt(g.idx)
	run := 0
	for i := len(keys) - 1; i >= 0; i-- {
		if !x.holds(e, keys[i]^salt) {
			run = 0
			continue
		}
		if run++; run >= g.window {
			return i + run
		}
	}
	return run
}

// holds reports whether e holds the block keyed k on a tier of weight above 0.
func (x *Index) holds(e *Engine, k uint64) bool {
	w, ok := x.blocks.get(k)
	if !ok {
		return false
	}
	var one [1]uint64
	hs := x.holders(w, &one)
	i, found := searchHolders(hs, e.id)
	if !found {
		return false
	}
	slot, _ := x.best(holderCounts(hs[i]))
	return slot != noSlot
}

// Matches is what the index knows of every engine for one request (MatchAll).
type Matches struct {
	// found are the engines holding at least the request's first block, sorted by id.
	found []matchFound
}

type matchFound struct {
	e *Engine
	v View
}

// Of returns what the index knows of e for the request: its View, as Match would return it.
func (r *Matches) Of(e *Engine) View {
	lo, hi := 0, len(r.found)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if r.found[m].e.id < e.id {
			lo = m + 1
		} else {
			hi = m
		}
	}
	v := View{}
	if lo < len(r.found) && r.found[lo].e == e {
		v = r.found[lo].v
	}
	v.Last = e.lastTime()
	return v
}

// Len returns how many engines hold at least the request's first block.
func (r *Matches) Len() int { return len(r.found) }

// Each calls f with every engine holding at least the request's first block and its View, as
// Of would return it.
func (r *Matches) Each(f func(e *Engine, v View)) {
	for _, m := range r.found {
		v := m.v
		v.Last = m.e.lastTime()
		f(m.e, v)
	}
}

// MatchAll answers, into r, how many of m's leading tokens every engine holds, in one walk
// of the request's keys: a key's holders are the engines holding the block, and an engine's
// prefix ends at the first block it does not hold. Its cost grows with the blocks matched
// and the engines holding them, not with the engines the index knows.
func (x *Index) MatchAll(m *Matcher, r *Matches) {
	r.found = r.found[:0]
	x.mu.RLock()
	defer x.mu.RUnlock()
	for bs := range x.sizes {
		x.matchSize(m, bs, r)
	}
	x.narrowHybrid(m, r)
	slices.SortFunc(r.found, func(a, b matchFound) int { return cmp.Compare(a.e.id, b.e.id) })
}

// narrowHybrid narrows the matches of hybrid engines to what they reuse (prefixHeld), and
// leaves out those left with nothing.
func (x *Index) narrowHybrid(m *Matcher, r *Matches) {
	out := r.found[:0]
	for _, f := range r.found {
		if e := f.e; e.hybrid.Load() {
			if n := x.prefixHeld(m, e, f.v.Matched/e.blockSize); n*e.blockSize < f.v.Matched {
				if n == 0 {
					continue
				}
				f.v = x.viewLocked(m, e, n)
			}
		}
		out = append(out, f)
	}
	r.found = out
}

// matchSize walks m's keys in blocks of bs for the engines whose block size it is.
func (x *Index) matchSize(m *Matcher, bs int, r *Matches) {
	// The table lookups first, apart from the walk, and in runs of matchRun keys whose
	// slots are all read before any is looked up: the reads do not depend on each other, so
	// the processor has their cache misses in flight at once (a fresh prompt's blocks are
	// nowhere in the caches: one miss each, and as many for their holders' lists below).
	words := m.words[:0]
	var seen uint64
lookup:
	for i := 0; ; i += matchRun {
		keys := m.keysOf(bs, i+matchRun)
		if len(keys) <= i {
			break
		}
		run := keys[i:]
		for _, k := range run {
			seen += x.blocks.touch(k)
		}
		for _, k := range run {
			w, ok := x.blocks.get(k)
			if !ok {
				break lookup // no engine holds it, so no prefix goes on
			}
			words = append(words, w)
		}
	}
	m.words = words
	if len(words) == 0 {
		m.touched = seen
		return
	}
	// Then a read of every cache line of every holders' list, for the same reason; a list
	// the block before shares is read once.
	for i, w := range words {
		if w&listBit != 0 && (i == 0 || w != words[i-1]) {
			l := x.arena.list(listOff(w), listLen(w))
			for j := 0; j < len(l); j += 8 {
				seen += l[j]
			}
		}
	}
	m.touched = seen
	var lone [2][1]uint64
	alive := m.alive[:0]
	first := x.holders(words[0], &lone[1])
	for _, h := range first {
		e := x.byID[holderID(h)]
		if e == nil || e.blockSize != bs {
			continue
		}
		if slot, w := x.best(holderCounts(h)); slot != noSlot {
			a := matchAcc{e: e, id: e.id}
			a.add(slot, w, bs)
			alive = append(alive, a)
		}
	}
	// prev are the holders of the block before when every one of them is alive on a GPU
	// copy: a block with the very same holders then changes nothing but the blocks
	// matched, which a comparison of a few words tells. Along a shared prefix nearly every
	// block is so.
	prev := x.cleanHolders(first, len(alive))
	for i, w := range words[1:] {
		if len(alive) == 0 {
			break
		}
		if prev != nil && w == words[i] {
			continue // the very same holders as the block before, and not even read
		}
		// A lone holder is kept in one of two words, so that prev's is not overwritten.
		hs := x.holders(w, &lone[i&1])
		if prev != nil && slices.Equal(hs, prev) {
			continue
		}
		blocks := i + 1 // those before this one: where the prefixes that end here end
		j, kept := 0, alive[:0]
		for _, a := range alive {
			for j < len(hs) && holderID(hs[j]) < a.id {
				j++
			}
			if j < len(hs) && holderID(hs[j]) == a.id {
				if slot, wt := x.best(holderCounts(hs[j])); slot != noSlot {
					a.add(slot, wt, bs)
					kept = append(kept, a)
					continue
				}
			}
			r.found = append(r.found, matchFound{e: a.e, v: a.view(blocks, bs)})
		}
		alive = kept
		prev = x.cleanHolders(hs, len(alive))
	}
	for _, a := range alive {
		r.found = append(r.found, matchFound{e: a.e, v: a.view(len(words), bs)})
	}
	m.alive = alive
}

// cleanHolders returns hs if all of them are alive (alive of them are, and none are
// otherwise) on a GPU copy; nil if not.
func (x *Index) cleanHolders(hs []uint64, alive int) []uint64 {
	if len(hs) != alive {
		return nil
	}
	for _, h := range hs {
		if holderCounts(h)&slotMax == 0 {
			return nil
		}
	}
	return hs
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
	e := x.knownLocked(engine)
	if e == nil {
		return EngineStats{}, false
	}
	return x.statsLocked(e), true
}

func (x *Index) statsLocked(e *Engine) EngineStats {
	s := EngineStats{Blocks: e.copies.Len(), BlockSize: e.blockSize, Last: e.lastTime()}
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
		if e.known {
			out[name] = x.statsLocked(e)
		}
	}
	return out
}

// BlockKeys returns up to limit of the keys of engine's blocks, in no order: for showing
// an engine's cache as the proxy sees it, not for matching.
func (x *Index) BlockKeys(engine string, limit int) []uint64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	e := x.knownLocked(engine)
	if e == nil {
		return nil
	}
	out := make([]uint64, 0, min(limit, e.copies.Len()))
	seen := make(map[uint64]bool, cap(out))
	e.copies.each(func(k uint64) {
		if len(out) < limit && !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	})
	return out
}
