package kvcache

import (
	"math/bits"
	"unsafe"
)

// table is an open-addressing hash table from uint64 keys to V, with Robin Hood probing and
// backward-shift deletion: no tombstones, and a lookup of a missing key stops as soon as it
// passes where the key would be. It holds no pointers (the garbage collector never scans
// it) and costs 16 bytes a slot (a key and its value side by side, so that a lookup of a
// table larger than the caches misses once, not once for the key and once for the value),
// at a load between 0.56 and 0.85: the index keeps hundreds of millions of entries in such
// tables, where a Go map would grow by doubling. The zero value is an empty table.
type table[V uint32 | uint64] struct {
	// slots hold the keys mixed (mix, a bijection), 0 for an empty slot; the key whose mix
	// is 0 is held apart, in zero.
	slots []slot[V]
	n     int
	// hasZero and zero hold the value of the key whose mix is 0.
	hasZero bool
	zero    V
}

type slot[V uint32 | uint64] struct {
	key uint64
	val V
}

// Load bounds: above maxLoad the table grows by half; below a quarter it shrinks.
const (
	maxLoadNum, maxLoadDen = 85, 100
	minTableSlots          = 16
)

// mix is murmur3's 64-bit finalizer: a bijection that spreads keys an engine numbers in
// sequence (a simulator's block hashes) over the table.
func mix(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}

// Len returns how many keys the table holds.
func (t *table[V]) Len() int { return t.n }

// home is the slot a mixed key m belongs in: its place in [0, len) by its high bits.
func (t *table[V]) home(m uint64) int {
	hi, _ := bits.Mul64(m, uint64(len(t.slots)))
	return int(hi)
}

// dist is how far slot i is from m's home.
func (t *table[V]) dist(m uint64, i int) int {
	d := i - t.home(m)
	if d < 0 {
		d += len(t.slots)
	}
	return d
}

// find returns the slot of the mixed key m, -1 if absent.
func (t *table[V]) find(m uint64) int {
	i, _, found := t.probe(m)
	if !found {
		return -1
	}
	return i
}

// probe looks for the mixed key m: found, it returns m's slot; not, the slot where m would
// go and its distance from m's home there, or -1 if the table has no slots.
func (t *table[V]) probe(m uint64) (i, d int, found bool) {
	n := len(t.slots)
	if n == 0 {
		return -1, 0, false
	}
	i = t.home(m)
	for d = 0; ; d++ {
		c := t.slots[i].key
		if c == m {
			return i, d, true
		}
		if c == 0 || t.dist(c, i) < d {
			return i, d, false
		}
		if i++; i == n {
			i = 0
		}
	}
}

// touch reads the slot where k's search starts, and returns its key for the caller to keep
// (so that the read is not left out): reading the slots of many keys one after another,
// before working on them, has the processor wait for their cache misses together.
func (t *table[V]) touch(k uint64) uint64 {
	if len(t.slots) == 0 {
		return 0
	}
	return t.slots[t.home(mix(k))].key
}

// reserve grows the table, if need be, so that n more keys fit without a resize: the slots
// touch read stay the ones the keys go to.
func (t *table[V]) reserve(n int) {
	if (t.n+n)*maxLoadDen > len(t.slots)*maxLoadNum {
		t.resize(max(minTableSlots, len(t.slots)+len(t.slots)/2, (t.n+n)*maxLoadDen/maxLoadNum+1))
	}
}

// get returns k's value.
func (t *table[V]) get(k uint64) (V, bool) {
	m := mix(k)
	if m == 0 {
		return t.zero, t.hasZero
	}
	if i := t.find(m); i >= 0 {
		return t.slots[i].val, true
	}
	var none V
	return none, false
}

// ref returns where k's value is kept, nil if k is absent; valid until the table changes.
func (t *table[V]) ref(k uint64) *V {
	m := mix(k)
	if m == 0 {
		if t.hasZero {
			return &t.zero
		}
		return nil
	}
	if i := t.find(m); i >= 0 {
		return &t.slots[i].val
	}
	return nil
}

// put sets k's value.
func (t *table[V]) put(k uint64, v V) {
	m := mix(k)
	if m == 0 {
		if !t.hasZero {
			t.n++
		}
		t.hasZero, t.zero = true, v
		return
	}
	p, _ := t.upsertMixed(m)
	*p = v
}

// upsert returns where k's value is kept, adding k with the zero value if absent (added
// is then set); valid until the table changes.
func (t *table[V]) upsert(k uint64) (v *V, added bool) {
	m := mix(k)
	if m == 0 {
		if !t.hasZero {
			var none V
			t.hasZero, t.zero, added = true, none, true
			t.n++
		}
		return &t.zero, added
	}
	return t.upsertMixed(m)
}

// upsertMixed is upsert of the mixed key m, not 0: one probe finds m or where it goes.
func (t *table[V]) upsertMixed(m uint64) (v *V, added bool) {
	i, d, found := t.probe(m)
	if found {
		return &t.slots[i].val, false
	}
	var none V
	if (t.n+1)*maxLoadDen > len(t.slots)*maxLoadNum {
		t.resize(max(minTableSlots, len(t.slots)+len(t.slots)/2))
		i = t.insert(m, none)
	} else {
		t.place(i, d, m, none)
	}
	t.n++
	return &t.slots[i].val, true
}

// insert places the mixed key m, known absent, Robin Hood style: a key further from its
// home takes the slot of one nearer to its own, which moves on. It returns m's slot.
func (t *table[V]) insert(m uint64, v V) int {
	i, d, _ := t.probe(m)
	t.place(i, d, m, v)
	return i
}

// place puts the mixed key m, absent, in slot i, d from its home, where a probe for it
// stopped: the keys from i on, each nearer its home than m is there, move on by one, each
// as far as the first slot that is empty or holds a key nearer its own home.
func (t *table[V]) place(i, d int, m uint64, v V) {
	n := len(t.slots)
	for {
		c := t.slots[i]
		if c.key == 0 {
			t.slots[i] = slot[V]{m, v}
			return
		}
		if cd := t.dist(c.key, i); cd < d {
			t.slots[i] = slot[V]{m, v}
			m, v, d = c.key, c.val, cd
		}
		d++
		if i++; i == n {
			i = 0
		}
	}
}

// del removes k; false if it was absent.
func (t *table[V]) del(k uint64) bool {
	m := mix(k)
	if m == 0 {
		if !t.hasZero {
			return false
		}
		t.hasZero = false
		t.n--
		return true
	}
	i := t.find(m)
	if i < 0 {
		return false
	}
	n := len(t.slots)
	for {
		j := i + 1
		if j == n {
			j = 0
		}
		c := t.slots[j]
		if c.key == 0 || t.dist(c.key, j) == 0 {
			break
		}
		t.slots[i] = c
		i = j
	}
	t.slots[i] = slot[V]{}
	t.n--
	if len(t.slots) > minTableSlots && t.n*4 < len(t.slots) {
		t.resize(max(minTableSlots, t.n*maxLoadDen/maxLoadNum*3/2))
	}
	return true
}

// hugePage is a transparent huge page's size on amd64 and on arm64 with 4 KiB pages: a table
// of at least two is advised to be backed by them (adviseHuge).
const hugePage = 2 << 20

// resize moves every key into a table of slots slots.
func (t *table[V]) resize(slots int) {
	old := t.slots
	t.slots = make([]slot[V], slots)
	if size := int(unsafe.Sizeof(t.slots[0])) * slots; size >= 2*hugePage {
		adviseHuge(unsafe.Pointer(&t.slots[0]), size)
	}
	for _, s := range old {
		if s.key != 0 {
			t.insert(s.key, s.val)
		}
	}
}

// each calls f with every value, in no order.
func (t *table[V]) each(f func(V)) {
	if t.hasZero {
		f(t.zero)
	}
	for _, s := range t.slots {
		if s.key != 0 {
			f(s.val)
		}
	}
}
