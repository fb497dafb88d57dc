package kvcache

import (
	"encoding/binary"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// Events as an engine encodes them, array form (tag first, msgspec's field order).

func stored(hashes []uint64, parent any, tokens []uint32, blockSize int) []any {
	return []any{"BlockStored", hashes, parent, tokens, blockSize, nil, "GPU", nil}
}

func removed(hashes ...uint64) []any { return []any{"BlockRemoved", hashes, "GPU"} }

func cleared() []any { return []any{"AllBlocksCleared"} }

// payload is a batch as vLLM encodes it: [timestamp, [events], data_parallel_rank].
func payload(t testing.TB, events ...any) []byte {
	t.Helper()
	if events == nil {
		events = []any{}
	}
	p, err := msgpack.Marshal([]any{1733000000.5, events, 0})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	p, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func seqBytes(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// tokensN returns n token ids starting at from.
func tokensN(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// engineHashes makes an engine's block hashes for n blocks: seed makes them as unlike as
// two engines' hash seeds would.
func engineHashes(seed uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = seed*1_000_003 + uint64(i)*7919 + 1
	}
	return out
}
