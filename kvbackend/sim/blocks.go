package sim

// blockPool is the KV block allocator. Every allocated block records its
// owner, so that a second free of the same block (the bug behind vLLM's
// finished_sending crash, race R3) is detected and counted instead of pushing
// the block twice onto the free list and handing it to two requests later.
type blockPool struct {
	owner      []uint64 // owner[id] is the request seq holding block id; 0 = free
	free       []int    // stack of free block ids
	doubleFree int      // frees of blocks not owned by the freeing request
}

func newBlockPool(n int) *blockPool {
	p := &blockPool{owner: make([]uint64, n), free: make([]int, n)}
	// Hand out low ids first: the ids in kv_transfer_params read naturally.
	for i := range n {
		p.free[i] = n - 1 - i
	}
	return p
}

func (p *blockPool) total() int     { return len(p.owner) }
func (p *blockPool) available() int { return len(p.free) }

// alloc takes n blocks for owner, or none if fewer than n are free.
func (p *blockPool) alloc(n int, owner uint64) ([]int, bool) {
	if n > len(p.free) {
		return nil, false
	}
	ids := make([]int, n)
	for i := range ids {
		id := p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
		p.owner[id] = owner
		ids[i] = id
	}
	return ids, true
}

// release frees the blocks that owner holds among ids; any other id is a
// double free (or a free of someone else's block) and only counted.
func (p *blockPool) release(ids []int, owner uint64) (doubleFrees int) {
	for _, id := range ids {
		if id < 0 || id >= len(p.owner) || p.owner[id] != owner || owner == 0 {
			doubleFrees++
			continue
		}
		p.owner[id] = 0
		p.free = append(p.free, id)
	}
	p.doubleFree += doubleFrees
	return doubleFrees
}
