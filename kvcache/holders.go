package kvcache

// A block's holders are the engines that hold it, each with its copies per tier, packed in
// a uint64: the engine's id in the high 32 bits, 4 bits of copies per tier slot in the low
// 32. The blocks table keeps, per block key, one word: a lone holder itself (nearly every
// block an engine alone holds costs nothing more), or, with the top bit set, a list of
// holders in the arena, sorted by engine id, so that a match walks the engines holding a
// block in one pass over a few cache lines. Blocks whose holders one event changed alike
// share one list (Index.refs counts them), so that a prefix that the same engines store and
// evict as a whole takes one list, not one a block, and a match reads it once.

const (
	// listBit marks a blocks table word as a list in the arena, not a lone holder. A holder
	// never sets it: engine ids count the engines the index has known, far below 2^31.
	listBit = 1 << 63
	// pageShift is log2 of an arena page's holders: 512 KiB pages.
	pageShift = 16
	pageSize  = 1 << pageShift
	// maxClass is the largest list: 2^maxClass holders, a page, more engines than any pool.
	maxClass = pageShift
)

// holder packs engine id and its copies per slot.
func holder(id uint32, counts uint32) uint64 { return uint64(id)<<32 | uint64(counts) }

func holderID(h uint64) uint32     { return uint32(h >> 32) }
func holderCounts(h uint64) uint32 { return uint32(h) }

// listWord is the blocks table's word of a list of n holders at off, of capacity 2^class.
func listWord(off uint32, n, class int) uint64 {
	return listBit | uint64(class)<<48 | uint64(n)<<32 | uint64(off)
}

func listOff(w uint64) uint32 { return uint32(w) }
func listLen(w uint64) int    { return int(w>>32) & 0xffff }
func listClass(w uint64) int  { return int(w>>48) & 0x1f }

// arena holds the holder lists of blocks held by more than one engine, in pages of pageSize
// holders; a list of capacity 2^c never crosses a page. Freed lists are kept by class for
// the next list of that class.
type arena struct {
	pages [][]uint64
	// used is how many holders of the last page are handed out.
	used int
	free [maxClass + 1][]uint32
}

// alloc returns the offset of a list of capacity 2^class.
func (a *arena) alloc(class int) uint32 {
	if f := a.free[class]; len(f) > 0 {
		off := f[len(f)-1]
		a.free[class] = f[:len(f)-1]
		return off
	}
	size := 1 << class
	if len(a.pages) == 0 || a.used+size > pageSize {
		// The rest of the last page goes to the free lists, largest pieces first.
		if len(a.pages) > 0 {
			for c := maxClass; c >= 0; c-- {
				for a.used+1<<c <= pageSize {
					a.free[c] = append(a.free[c], uint32((len(a.pages)-1)<<pageShift+a.used))
					a.used += 1 << c
				}
			}
		}
		a.pages = append(a.pages, make([]uint64, pageSize))
		a.used = 0
	}
	off := uint32((len(a.pages)-1)<<pageShift + a.used)
	a.used += size
	return off
}

// release gives back the list of capacity 2^class at off.
func (a *arena) release(off uint32, class int) {
	a.free[class] = append(a.free[class], off)
}

// list is the n holders at off.
func (a *arena) list(off uint32, n int) []uint64 {
	p := a.pages[off>>pageShift]
	i := int(off & (pageSize - 1))
	return p[i : i+n : i+n]
}

// searchHolders returns where id is, or would be, in hs (sorted by id), and whether it is.
func searchHolders(hs []uint64, id uint32) (int, bool) {
	lo, hi := 0, len(hs)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if holderID(hs[m]) < id {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < len(hs) && holderID(hs[lo]) == id
}
