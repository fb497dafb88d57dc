package hftok

import (
	"sync"
	"sync/atomic"
)

// maxCachedWords bounds the cache of words' tokens: once full it starts again, which costs
// a prompt of new words no more than an empty cache does.
const maxCachedWords = 1 << 16

// pair is two adjacent tokens of a word.
type pair struct{ a, b uint32 }

// merge is what a pair becomes and how early in the merge list it comes.
type merge struct {
	rank int
	id   uint32
}

// bpe is a byte-level BPE model: a word's bytes, as tokens of one byte each, merged pair by
// pair, the pair of lowest rank first (the leftmost among equals), until no pair merges.
type bpe struct {
	vocab        map[string]uint32
	byteIDs      [256]uint32
	merges       map[pair]merge
	ignoreMerges bool // a word that is a token of its own is that token, merges or not

	// cache holds words' tokens (string to []uint32), read without a lock on the hot path;
	// cached counts its entries, roughly.
	cache  sync.Map
	cached atomic.Int64
}

// encode appends the tokens of word (raw bytes, not yet mapped to characters) to dst.
func (m *bpe) encode(dst []uint32, word string) []uint32 {
	if ids, ok := m.cache.Load(word); ok {
		return append(dst, ids.([]uint32)...)
	}
	ids := m.merge(word)
	if m.cached.Add(1) > maxCachedWords {
		m.cache.Clear()
		m.cached.Store(0)
	}
	// The word may be a slice of a large prompt: the cache keeps a copy, not the prompt.
	m.cache.Store(string([]byte(word)), ids)
	return append(dst, ids...)
}

func (m *bpe) merge(word string) []uint32 {
	if m.ignoreMerges {
		var mapped []byte
		for i := 0; i < len(word); i++ {
			mapped = append(mapped, byteChars[word[i]]...)
		}
		if id, ok := m.vocab[string(mapped)]; ok {
			return []uint32{id}
		}
	}
	ids := make([]uint32, len(word))
	for i := 0; i < len(word); i++ {
		ids[i] = m.byteIDs[word[i]]
	}
	for len(ids) > 1 {
		best, at := merge{rank: -1}, -1
		for i := 0; i+1 < len(ids); i++ {
			if mg, ok := m.merges[pair{ids[i], ids[i+1]}]; ok && (at < 0 || mg.rank < best.rank) {
				best, at = mg, i
			}
		}
		if at < 0 {
			break
		}
		// Every occurrence of the pair merges in this round, left to right, as a pair
		// never overlaps itself once merged.
		target := pair{ids[at], ids[at+1]}
		out := ids[:at]
		for i := at; i < len(ids); {
			if i+1 < len(ids) && ids[i] == target.a && ids[i+1] == target.b {
				out = append(out, best.id)
				i += 2
				continue
			}
			out = append(out, ids[i])
			i++
		}
		ids = out
	}
	return ids
}
