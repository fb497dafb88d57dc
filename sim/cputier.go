package sim

import "container/list"

// cpuTier is the KV blocks offloaded to CPU memory, as vLLM's OffloadingConnector
// keeps them (its CPU backend with an LRU policy): a bounded set of block hashes,
// least recently used first. It holds no token data: a block reloaded from it is
// filled from the reloading request's own prompt, whose hash chain says the tokens
// are the same.
type cpuTier struct {
	capacity int
	lru      *list.List               // block hashes, least recently used first
	elem     map[uint64]*list.Element // hash -> its element in lru
}

func newCPUTier(capacity int) *cpuTier {
	return &cpuTier{capacity: capacity, lru: list.New(), elem: make(map[uint64]*list.Element, capacity)}
}

func (c *cpuTier) len() int { return c.lru.Len() }

// hits is how many leading blocks of hashes the tier holds.
func (c *cpuTier) hits(hashes []uint64) int {
	for i, h := range hashes {
		if _, ok := c.elem[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// touch makes h the most recently used block; false when the tier lacks it.
func (c *cpuTier) touch(h uint64) bool {
	e, ok := c.elem[h]
	if ok {
		c.lru.MoveToBack(e)
	}
	return ok
}

// add stores h, which the tier lacks, as its most recently used block; when the
// tier was full it drops its least recently used block first and returns it.
func (c *cpuTier) add(h uint64) (dropped uint64, ok bool) {
	if c.lru.Len() >= c.capacity {
		dropped = c.lru.Remove(c.lru.Front()).(uint64)
		delete(c.elem, dropped)
		ok = true
	}
	c.elem[h] = c.lru.PushBack(h)
	return dropped, ok
}

// clear drops every block.
func (c *cpuTier) clear() {
	c.lru.Init()
	clear(c.elem)
}
