package sim

import (
	"crypto/sha256"
	"encoding/binary"
)

// How a KV block is keyed, as vLLM keys it: the chained hash of its tokens,
// what keys it beyond them (the LoRA adapter, the cache_salt), and the KV
// cache group it belongs to.

// blockHashes chains the hashes of the full blocks of tokens of a request keyed
// by key: block i's is the last 8 bytes of sha256(hash of block i-1, its tokens,
// its extra keys), as vLLM's sha256 block hash (hash_block_tokens), whose
// published form is those 8 bytes as a uint64. The first block's parent is 0.
func blockHashes(tokens []uint32, size int, key cacheKey) []uint64 {
	n := len(tokens) / size
	out := make([]uint64, n)
	buf := make([]byte, 8+4*size, 8+4*size+len(key.lora)+len(key.salt)+16)
	var parent uint64
	for i := range n {
		buf = buf[:8+4*size]
		binary.BigEndian.PutUint64(buf, parent)
		for j, t := range tokens[i*size : (i+1)*size] {
			binary.BigEndian.PutUint32(buf[8+4*j:], t)
		}
		for _, x := range key.extra(i) {
			s := x.(string)
			buf = binary.BigEndian.AppendUint32(buf, uint32(len(s)))
			buf = append(buf, s...)
		}
		sum := sha256.Sum256(buf)
		parent = binary.BigEndian.Uint64(sum[24:])
		out[i] = parent
	}
	return out
}

// cacheKey is what a request's KV blocks are keyed by beyond their tokens, as vLLM keys
// them (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys): the LoRA
// adapter's name in every block, the cache_salt in the first. The zero cacheKey is a
// request of the base model without a salt.
type cacheKey struct {
	lora   string
	loraID int // vLLM's lora_request.adapter_id: the adapter's place in --lora-modules, from 1
	salt   string
}

// extra is the extra keys of block i, as vLLM's tuple of them; nil for none.
func (k cacheKey) extra(i int) []any {
	var out []any
	if k.lora != "" {
		out = append(out, k.lora)
	}
	if i == 0 && k.salt != "" {
		out = append(out, k.salt)
	}
	return out
}

// windowGroupIdx is the sliding-window group's group_idx; the full-attention group's is 0.
const windowGroupIdx = 1
