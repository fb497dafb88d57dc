package kvcache

import "math/bits"

// table is an open-addressing hash table from uint64 keys to V, with Robin Hood probing and
// backward-shift deletion: no tombstones, and a lookup of a missing key stops as soon as it
// passes where the key would be. It holds no pointers (the garbage collector never scans
// it) and costs 8 bytes plus V per slot, at a load between 0.56 and 0.85: the index keeps
// hundreds of millions of entries in such tables, where a Go map would pad a uint32 value
// to 16 bytes a slot and grow by doubling. The zero value is an empty table.
type table[V uint32 | uint64] struct {
	// keys are the keys mixed (mix, a bijection), 0 for an empty slot; the key whose mix is
	// 0 is held apart, in zero.
	keys []uint64
	vals []V
	n    int
	// hasZero and zero hold the value of the key whose mix is 0.
	hasZero bool
	zero    V
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
	hi, _ := bits.Mul64(m, uint64(len(t.keys)))
	return int(hi)
}

// dist is how far slot i is from m's home.
func (t *table[V]) dist(m uint64, i int) int {
	d := i - t.home(m)
	if d < 0 {
		d += len(t.keys)
	}
	return d
}

// find returns the slot of the mixed key m, -1 if absent.
func (t *table[V]) find(m uint64) int {
	n := len(t.keys)
	if n == 0 {
		return -1
	}
	i := t.home(m)
	for d := 0; ; d++ {
		c := t.keys[i]
		if c == m {
			return i
		}
		if c == 0 || t.dist(c, i) < d {
			return -1
		}
		if i++; i == n {
			i = 0
		}
	}
}

// get returns k's value.
func (t *table[V]) get(k uint64) (V, bool) {
	m := mix(k)
	if m == 0 {
		return t.zero, t.hasZero
	}
	if i := t.find(m); i >= 0 {
		return t.vals[i], true
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
		return &t.vals[i]
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
	if i := t.find(m); i >= 0 {
		t.vals[i] = v
		return
	}
	if (t.n+1)*maxLoadDen > len(t.keys)*maxLoadNum {
		t.resize(max(minTableSlots, len(t.keys)+len(t.keys)/2))
	}
	t.insert(m, v)
	t.n++
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
	if i := t.find(m); i >= 0 {
		return &t.vals[i], false
	}
	if (t.n+1)*maxLoadDen > len(t.keys)*maxLoadNum {
		t.resize(max(minTableSlots, len(t.keys)+len(t.keys)/2))
	}
	var none V
	i := t.insert(m, none)
	t.n++
	return &t.vals[i], true
}

// insert places the mixed key m, known absent, Robin Hood style: a key further from its
// home takes the slot of one nearer to its own, which moves on. It returns m's slot.
func (t *table[V]) insert(m uint64, v V) int {
	n := len(t.keys)
	i := t.home(m)
	at := -1
	for d := 0; ; d++ {
		c := t.keys[i]
		if c == 0 {
			t.keys[i], t.vals[i] = m, v
			if at < 0 {
				at = i
			}
			return at
		}
		if cd := t.dist(c, i); cd < d {
			t.keys[i], m = m, c
			t.vals[i], v = v, t.vals[i]
			d = cd
			if at < 0 {
				at = i
			}
		}
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
	n := len(t.keys)
	for {
		j := i + 1
		if j == n {
			j = 0
		}
		c := t.keys[j]
		if c == 0 || t.dist(c, j) == 0 {
			break
		}
		t.keys[i], t.vals[i] = c, t.vals[j]
		i = j
	}
	t.keys[i] = 0
	t.n--
	if len(t.keys) > minTableSlots && t.n*4 < len(t.keys) {
		t.resize(max(minTableSlots, t.n*maxLoadDen/maxLoadNum*3/2))
	}
	return true
}

// resize moves every key into a table of slots slots.
func (t *table[V]) resize(slots int) {
	keys, vals := t.keys, t.vals
	t.keys, t.vals = make([]uint64, slots), make([]V, slots)
	for i, m := range keys {
		if m != 0 {
			t.insert(m, vals[i])
		}
	}
}

// each calls f with every value, in no order.
func (t *table[V]) each(f func(V)) {
	if t.hasZero {
		f(t.zero)
	}
	for i, m := range t.keys {
		if m != 0 {
			f(t.vals[i])
		}
	}
}
