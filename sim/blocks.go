package sim

import (
	"container/list"
	"slices"
)

// blockPool is the KV block allocator and, over the same blocks, the prefix
// cache, as vLLM V1's block pool is.
//
// Every allocated block records the requests referencing it, so that a
// second free of the same block by the same request (the bug behind vLLM's
// finished_sending crash, race R3) is detected and counted instead of
// handing the block to two requests later. A block is referenced by several
// requests when their prompts share a cached prefix.
//
// A block whose tokens are a full block of a prompt that was computed (or
// pulled) is cached under its block hash, which chains the parent block's
// hash with the block's tokens. A cached block nobody references stays in
// the cache, in LRU order, until a new allocation needs it: it counts as
// free. Released blocks join the LRU list tail first, as vLLM frees them, so
// that a prompt's last blocks go before its first ones.
type blockPool struct {
	refs       [][]uint64 // refs[id]: the seqs of the requests referencing block id
	free       []int      // stack of blocks that hold nothing
	doubleFree int        // frees of blocks not referenced by the freeing request

	caching bool
	hashOf  []uint64        // a cached block's hash
	cached  []bool          // block id is in byHash
	byHash  map[uint64]int  // the cache: block hash -> block id
	lru     *list.List      // cached blocks nobody references, least recently used first
	lruElem []*list.Element // block id's element in lru, nil when referenced or uncached
	// A cached block's tokens and parent hash (hasParent false for a prompt's first
	// block): what its copy on CPU is published with when it is evicted there.
	tokensOf  [][]uint32
	parentOf  []uint64
	hasParent []bool
	// keyOf is a cached block's key beyond its tokens (the LoRA, the cache_salt of the
	// request that cached it): what its events carry as lora_name and extra_keys.
	keyOf  []cacheKey
	cpu    *cpuTier     // nil without a CPU tier
	window *windowGroup // nil without a sliding-window group
	events []kvEvent    // what changed in the cache since the last take
}

// newBlockPool builds a pool of n GPU blocks and, when cpuBlocks > 0 and caching is
// on, a CPU tier of cpuBlocks blocks that the GPU's evicted blocks move to; with a
// slidingWindow of tokens and caching on, a second KV cache group of sliding-window
// attention (windowGroup) beside the full-attention one, of blocks of blockSize.
func newBlockPool(n int, caching bool, cpuBlocks, slidingWindow, blockSize int) *blockPool {
	p := &blockPool{
		refs: make([][]uint64, n), free: make([]int, n), caching: caching,
		hashOf: make([]uint64, n), cached: make([]bool, n), byHash: make(map[uint64]int),
		lru: list.New(), lruElem: make([]*list.Element, n),
		tokensOf: make([][]uint32, n), parentOf: make([]uint64, n), hasParent: make([]bool, n),
		keyOf: make([]cacheKey, n),
	}
	if caching && cpuBlocks > 0 {
		p.cpu = newCPUTier(cpuBlocks)
	}
	if caching && slidingWindow > 0 {
		p.window = newWindowGroup(slidingWindow, blockSize, n)
	}
	// Hand out low ids first: the ids in kv_transfer_params read naturally.
	for i := range n {
		p.free[i] = n - 1 - i
	}
	return p
}

func (p *blockPool) total() int { return len(p.refs) }

// available is the blocks an allocation may take: those holding nothing and
// the cached ones nobody references.
func (p *blockPool) available() int { return len(p.free) + p.lru.Len() }

// cachedBlocks is the blocks in the prefix cache, referenced or not.
func (p *blockPool) cachedBlocks() int { return len(p.byHash) }

// cpuCachedBlocks is the blocks the CPU tier holds.
func (p *blockPool) cpuCachedBlocks() int {
	if p.cpu == nil {
		return 0
	}
	return p.cpu.len()
}

// hits is how many leading blocks of hashes are cached.
func (p *blockPool) hits(hashes []uint64) int {
	if !p.caching {
		return 0
	}
	for i, h := range hashes {
		if _, ok := p.byHash[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// alloc takes n blocks for owner, the first ones from the cache where the
// leading blocks of lookup are cached, or none if the pool cannot give n.
// hit is how many came from the cache. With reload, the blocks of lookup
// that follow those on the CPU tier are reloaded from it: reloaded is how
// many, the blocks after the hit ones, which the owner's prompt fills as it
// fills the blocks it computes (store caches them on GPU again); their CPU
// copies stay, used last.
//
// With a sliding-window group the hit is what both groups reuse (windowGroup.hit), and
// nothing is reloaded: the window's group has no CPU tier.
func (p *blockPool) alloc(n int, owner uint64, lookup []uint64, reload bool) (ids []int, hit, reloaded int, ok bool) {
	hit = min(p.hits(lookup), n)
	if p.window != nil {
		hit = p.window.hit(lookup[:hit])
	} else if reload && p.cpu != nil {
		reloaded = min(p.cpu.hits(lookup[hit:]), n-hit)
	}
	reusable := 0 // hit blocks nobody references: they are not free for the rest
	for _, h := range lookup[:hit] {
		if p.lruElem[p.byHash[h]] != nil {
			reusable++
		}
	}
	if n-hit > p.available()-reusable {
		return nil, 0, 0, false
	}
	// Touched before the allocation below evicts blocks to the CPU tier, so that
	// they are the last the tier drops.
	for _, h := range lookup[hit : hit+reloaded] {
		p.cpu.touch(h)
	}
	if p.window != nil {
		p.window.touch(lookup[:hit])
	}
	ids = make([]int, 0, n)
	for _, h := range lookup[:hit] {
		id := p.byHash[h]
		p.unlink(id)
		p.refs[id] = append(p.refs[id], owner)
		ids = append(ids, id)
	}
	for len(ids) < n {
		var id int
		if len(p.free) > 0 {
			id = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		} else {
			id = p.evict()
		}
		p.refs[id] = append(p.refs[id], owner)
		ids = append(ids, id)
	}
	return ids, hit, reloaded, true
}

// evict takes the least recently used unreferenced cached block out of the
// cache and returns it. With a CPU tier the block moves there first, so
// that a consumer of the events never sees it held nowhere.
func (p *blockPool) evict() int {
	id := p.lru.Remove(p.lru.Front()).(int)
	p.lruElem[id] = nil
	h := p.hashOf[id]
	delete(p.byHash, h)
	p.cached[id] = false
	if p.cpu != nil {
		p.offload(id)
	}
	p.tokensOf[id] = nil
	p.keyOf[id] = cacheKey{}
	p.addEvent(kvEvent{kind: eventBlockRemoved, hashes: []uint64{h}})
	return id
}

// offload copies GPU block id to the CPU tier: a block the tier holds
// already is only made its most recently used; a new one may drop the
// tier's least recently used.
func (p *blockPool) offload(id int) {
	h := p.hashOf[id]
	if p.cpu.touch(h) {
		return
	}
	if dropped, ok := p.cpu.add(h); ok {
		p.addEvent(kvEvent{kind: eventBlockRemoved, hashes: []uint64{dropped}, medium: mediumCPU})
	}
	ev := kvEvent{kind: eventBlockStored, hashes: []uint64{h}, tokens: p.tokensOf[id], blockSize: len(p.tokensOf[id]), medium: mediumCPU}
	first := 0
	if p.hasParent[id] {
		parent := p.parentOf[id]
		ev.parent = &parent
		first = 1
	}
	ev.keyed(p.keyOf[id], first, 1)
	p.addEvent(ev)
}

func (p *blockPool) unlink(id int) {
	if e := p.lruElem[id]; e != nil {
		p.lru.Remove(e)
		p.lruElem[id] = nil
	}
}

// release drops owner's references to ids; an id owner does not reference
// is a double free (or a free of someone else's block) and only counted. A
// block nobody references any more joins the LRU list if cached, the free
// stack otherwise.
func (p *blockPool) release(ids []int, owner uint64) (doubleFrees int) {
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		if id < 0 || id >= len(p.refs) || owner == 0 {
			doubleFrees++
			continue
		}
		k := slices.Index(p.refs[id], owner)
		if k < 0 {
			doubleFrees++
			continue
		}
		p.refs[id] = slices.Delete(p.refs[id], k, k+1)
		if len(p.refs[id]) > 0 {
			continue
		}
		if p.cached[id] {
			p.lruElem[id] = p.lru.PushBack(id)
		} else {
			p.free = append(p.free, id)
		}
	}
	p.doubleFree += doubleFrees
	return doubleFrees
}

// store caches the full blocks of a computed (or pulled) prompt of a request keyed
// by key: block i of ids holds tokens[i*size:(i+1)*size] and hashes[i] is its
// hash. A block already cached, or whose hash another block caches (two requests
// computed the same prefix at once), stays as it is. The sliding-window group, if
// any, caches the prompt's last blocks after (windowGroup.store).
func (p *blockPool) store(ids []int, hashes []uint64, tokens []uint32, size int, key cacheKey) {
	if !p.caching {
		return
	}
	var run *kvEvent
	firstNew := len(hashes)
	defer func() {
		if p.window != nil {
			p.events = p.window.store(p.events, hashes[:min(len(hashes), len(ids))], tokens, size, key, firstNew)
		}
	}()
	for i, h := range hashes {
		if i >= len(ids) {
			break
		}
		id := ids[i]
		if p.cached[id] {
			run = nil
			continue
		}
		if _, dup := p.byHash[h]; dup {
			run = nil
			continue
		}
		p.cached[id], p.hashOf[id], p.byHash[h] = true, h, id
		p.tokensOf[id] = tokens[i*size : (i+1)*size]
		p.keyOf[id] = key
		p.hasParent[id] = i > 0
		if i > 0 {
			p.parentOf[id] = hashes[i-1]
		}
		firstNew = min(firstNew, i)
		if run == nil {
			p.addEvent(kvEvent{kind: eventBlockStored, blockSize: size, lora: key.lora, loraID: key.loraID, hasExtra: true})
			run = &p.events[len(p.events)-1]
			if i > 0 {
				parent := hashes[i-1]
				run.parent = &parent
			}
		}
		run.hashes = append(run.hashes, h)
		run.tokens = append(run.tokens, tokens[i*size:(i+1)*size]...)
		run.extra = append(run.extra, key.extra(i))
	}
}

// clear empties the cache of every block nobody references (all of them,
// once an engine crashed and ended every request), and the CPU tier: the
// process that held it died too. AllBlocksCleared says so for every medium.
func (p *blockPool) clear() {
	cpuHeld := p.cpu != nil && p.cpu.len() > 0
	if len(p.byHash) == 0 && !cpuHeld {
		return
	}
	if p.cpu != nil {
		p.cpu.clear()
	}
	for e := p.lru.Front(); e != nil; e = p.lru.Front() {
		id := p.lru.Remove(e).(int)
		p.lruElem[id] = nil
		delete(p.byHash, p.hashOf[id])
		p.cached[id] = false
		p.tokensOf[id] = nil
		p.keyOf[id] = cacheKey{}
		p.free = append(p.free, id)
	}
	if p.window != nil {
		p.window.clear()
	}
	p.addEvent(kvEvent{kind: eventAllBlocksCleared})
}

func (p *blockPool) addEvent(ev kvEvent) {
	p.events = append(p.events, ev)
}

// takeEvents returns the cache's changes since the last call.
func (p *blockPool) takeEvents() []kvEvent {
	ev := p.events
	p.events = nil
	return ev
}
