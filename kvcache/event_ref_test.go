package kvcache

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// refDecodeBatch decodes a payload as DecodeBatch does, by another way: through
// vmihailenco/msgpack's Decoder, one call per value but for the arrays of integers. The
// tests decode every input both ways and want the same batch, or an error from both.
func refDecodeBatch(payload []byte) (Batch, error) {
	r := newRefReader(payload)
	b, err := r.batch()
	if err == nil && r.br.Len() != 0 {
		err = errors.New("trailing bytes after the batch")
	}
	if err != nil {
		return Batch{}, &DecodeError{ReasonDecode, err}
	}
	return b, nil
}

// decodeSeeds are payloads of every shape an engine publishes and the decoders read:
// vLLM's and SGLang's array events (BlockStored of 6, 7, 8 and 9 fields, BlockRemoved,
// AllBlocksCleared) and vLLM's map events, in array and map batches, with hashes as
// integers of every width and sign and as bytes, media of every tier, token ids of every
// width, keyed blocks, unknown tags and fields, and a few that are not batches at all.
func decodeSeeds(t testing.TB) [][]byte {
	toks := []uint32{0, 1, 127, 128, 255, 256, 65535, 65536, 128000, 1<<32 - 1, 7, 8, 9, 10, 11, 12}
	batch := func(events ...any) any { return []any{1733000000.5, events, 0} }
	values := []any{
		batch(stored([]uint64{1, 2}, nil, tokensN(0, 32), 16), removed(1), cleared()),
		batch(stored([]uint64{1 << 63, 200, 70000, 1 << 40}, uint64(5), slices.Concat(toks, toks, toks, toks), 16)),
		batch([]any{"BlockStored", []any{int64(-2), int8(-100), int16(-30000), int32(-2e9), uint8(200), uint16(60000), uint32(4e9)}, int64(-1), tokensN(0, 7), 1, nil, "CPU"}),
		batch([]any{"BlockStored", []any{[]byte("abcdefghij"), []byte{1, 2}, "xyz"}, []byte("x"), tokensN(0, 6), 2, 1, nil, "lora"}),
		batch([]any{"BlockStored", []uint64{7}, uint64(6), tokensN(0, 16), 16, nil}),
		batch([]any{"BlockStored", []uint64{3}, nil, tokensN(0, 4), 4, nil, "GPU", nil, []any{[]any{"salt"}}}),
		batch([]any{"BlockStored", []uint64{4}, nil, tokensN(0, 4), 0, nil, "LocalDisk", nil, []any{nil}}, []any{"BlockRemoved", []uint64{4}, "cpu"}),
		batch([]any{"BlockRemoved", nil, nil}, []any{"BlockMoved", []any{1, 2, map[string]any{"x": []any{1.5, true, nil}}}}, []any{"AllBlocksCleared", 1}),
		batch(stored([]uint64{1, 2}, nil, tokensN(0, 20), 16), stored([]uint64{1, 2, 3}, nil, tokensN(0, 20), 0)),
		batch([]any{"BlockStored", []uint64{3, 4}, nil, tokensN(0, 8), 4, 1, "GPU", "a",
			[]any{[]any{"a", []any{"mm", -3}, "salt", []byte{1, 2}}, nil}, 1, "sliding_window", 128},
			[]any{"BlockStored", []uint64{5}, uint64(4), tokensN(0, 12), 4, nil, "GPU", nil,
				[]any{[]any{1.5, float32(2.5), true, false, map[string]any{"k": nil}, msgpack.RawMessage{0xd4, 0x05, 0x01}}}, nil, "mamba", nil},
			[]any{"BlockRemoved", []uint64{3}, "GPU", 1}),
		map[string]any{"ts": 1.0, "events": []any{
			map[string]any{"type": "BlockStored", "block_hashes": []uint64{9}, "token_ids": tokensN(0, 16), "block_size": 4,
				"lora_name": "x", "extra_keys": []any{[]any{"x"}}, "group_idx": 2, "kv_cache_spec_kind": "sliding_window_mla", "kv_cache_spec_sliding_window": 5},
			map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{9}, "group_idx": 2, "medium": nil},
		}},
		map[string]any{"ts": 1.0, "data_parallel_rank": 2, "events": []any{
			map[string]any{"type": "BlockStored", "block_hashes": []uint64{9}, "parent_block_hash": nil,
				"token_ids": tokensN(0, 16), "block_size": 16, "lora_name": nil, "extra_keys": []any{nil}, "group_idx": 0},
			map[string]any{"block_hashes": []uint64{9}, "type": "BlockRemoved", "medium": "GPU"},
			map[string]any{"type": "AllBlocksCleared"},
			map[string]any{"type": "Unknown", "token_ids": []int{1}},
		}},
		map[string]any{"ts": 1, "events": []any{map[string]any{"type": "BlockRemoved", "block_hashes": []int{1}}}, "data_parallel_rank": nil},
		[]any{1.0, []any{}},
		[]any{1.0, []any{cleared()}, 3, "more", map[string]any{"a": 1}},
		[]any{1.0, 5},
	}
	var seeds [][]byte
	for _, v := range values {
		// Each as msgpack's Encoder writes integers (at their type's width) and as msgspec,
		// vLLM's and SGLang's encoder, does (in the fewest bytes).
		seeds = append(seeds, mustMarshal(t, v))
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		enc.UseCompactInts(true)
		if err := enc.Encode(v); err != nil {
			t.Fatal(err)
		}
		seeds = append(seeds, buf.Bytes())
	}
	return append(seeds,
		[]byte{0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff},
		[]byte{0x92, 0x01, 0x91, 0x94, 0xa9, 'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 0xc7, 0x02, 0x01, 0xaa, 0xbb, 0xd6, 0x05, 1, 2, 3, 4, 0xc1},
		append([]byte{0x92, 0x01, 0x91, 0x92, 0xa1, 'X'}, bytes.Repeat([]byte{0x91}, 20)...))
}

// sameDecoding fails t unless DecodeBatch, a Decoder used before (d) and refDecodeBatch
// all decode p alike: the same batch, or each an error.
func sameDecoding(t *testing.T, d *Decoder, p []byte) {
	t.Helper()
	want, wantErr := refDecodeBatch(p)
	got, err := DecodeBatch(p)
	again, againErr := d.DecodeBatch(p)
	var de *DecodeError
	switch {
	case (err == nil) != (wantErr == nil) || (againErr == nil) != (wantErr == nil):
		t.Fatalf("payload %x: errors %v and %v (reused decoder), want %v", p, err, againErr, wantErr)
	case err != nil && (!errors.As(err, &de) || de.Reason != ReasonDecode):
		t.Fatalf("payload %x: error %v is no DecodeError of reason %q", p, err, ReasonDecode)
	case !sameBatch(got, want) || !sameBatch(again, want):
		t.Fatalf("payload %x: decoded %+v and %+v (reused decoder), want %+v", p, got, again, want)
	}
}

func TestDecodeMatchesReference(t *testing.T) {
	// Each seed whole, cut short at every length, and with each byte replaced by ones that
	// change what it means: nil, fixints, an array, a map, a string, an integer of each
	// width, an extension, the unused code.
	codes := []byte{0x00, 0x01, 0x10, 0x7f, 0x80, 0x81, 0x90, 0x91, 0xa0, 0xa3, 0xc0, 0xc1, 0xc4, 0xc7,
		0xcc, 0xcd, 0xce, 0xcf, 0xd3, 0xd4, 0xd9, 0xdc, 0xdd, 0xde, 0xe0, 0xff}
	var d Decoder
	for i, seed := range decodeSeeds(t) {
		t.Run(fmt.Sprintf("seed %d", i), func(t *testing.T) {
			for n := range len(seed) + 1 {
				sameDecoding(t, &d, seed[:n])
			}
			c := bytes.Clone(seed)
			for j := range c {
				for _, b := range append(codes, seed[j]+1, seed[j]-1) {
					c[j] = b
					sameDecoding(t, &d, c)
				}
				c[j] = seed[j]
			}
		})
	}
}

func FuzzDecodeMatchesReference(f *testing.F) {
	for _, s := range decodeSeeds(f) {
		f.Add(s)
	}
	var d Decoder
	f.Fuzz(func(t *testing.T, p []byte) { sameDecoding(t, &d, p) })
}

type refReader struct {
	// p is the whole payload, which br reads: the arrays of integers are read from it
	// directly (rawInt), the decoder told where they end.
	p  []byte
	br *bytes.Reader
	d  *msgpack.Decoder
}

func newRefReader(p []byte) *refReader {
	br := bytes.NewReader(p)
	// A bytes.Reader is an io.ByteScanner, so the decoder reads it directly, unbuffered:
	// br.Len() is what is left, which bounds every length the payload claims.
	return &refReader{p: p, br: br, d: msgpack.NewDecoder(br)}
}

// pos is where the decoder is in p.
func (r *refReader) pos() int { return len(r.p) - r.br.Len() }

// seek moves the decoder to pos in p.
func (r *refReader) seek(pos int) { _, _ = r.br.Seek(int64(pos), io.SeekStart) }

// head reads an array's or map's length, checked against the bytes left (every element
// takes at least one) and limit.
func (r *refReader) head(limit int) (container, int, error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return other, 0, err
	}
	var kind container
	var n int
	switch {
	case c == msgpcode.Nil:
		_, err = r.br.ReadByte()
		return null, 0, err
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		kind = array
		n, err = r.d.DecodeArrayLen()
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		kind = mapping
		n, err = r.d.DecodeMapLen()
	default:
		return other, 0, nil
	}
	if err != nil {
		return other, 0, err
	}
	per := 1
	if kind == mapping {
		per = 2
	}
	if n < 0 || n > limit || n*per > r.br.Len() {
		return other, 0, fmt.Errorf("claims %d elements with %d bytes left (limit %d)", n, r.br.Len(), limit)
	}
	return kind, n, nil
}

// skip skips one value of any type, nested at most maxDepth deep.
func (r *refReader) skip(depth int) error {
	if depth > maxDepth {
		return errors.New("nested too deep")
	}
	kind, n, err := r.head(math.MaxInt32)
	if err != nil {
		return err
	}
	switch kind {
	case null:
		return nil
	case array:
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case mapping:
		for range 2 * n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	}
	c, err := r.d.PeekCode()
	if err != nil {
		return err
	}
	if msgpcode.IsString(c) || msgpcode.IsBin(c) {
		_, err := r.bytes(math.MaxInt32)
		return err
	}
	// A scalar or an extension: nothing the decoder could recurse into.
	return r.d.Skip()
}

// bytes reads a str or bin, at most limit bytes long.
func (r *refReader) bytes(limit int) ([]byte, error) {
	n, err := r.d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 || n > limit || n > r.br.Len() {
		return nil, fmt.Errorf("claims %d bytes with %d left (limit %d)", n, r.br.Len(), limit)
	}
	p := make([]byte, n)
	_, err = io.ReadFull(r.br, p)
	return p, err
}

// str reads a string or nil (as ""); anything else is an error.
func (r *refReader) str() (string, error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		_, err = r.br.ReadByte()
		return "", err
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return "", fmt.Errorf("want a string, got code %#x", c)
	}
	p, err := r.bytes(maxString)
	return string(p), err
}

// int reads an integer in [lo, hi].
func (r *refReader) int(lo, hi int64) (int64, error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return 0, err
	}
	if !isInt(c) {
		return 0, fmt.Errorf("want an integer, got code %#x", c)
	}
	if c == msgpcode.Uint64 {
		v, err := r.d.DecodeUint64()
		if err != nil {
			return 0, err
		}
		if v > uint64(hi) {
			return 0, fmt.Errorf("%d out of [%d, %d]", v, lo, hi)
		}
		return int64(v), nil
	}
	v, err := r.d.DecodeInt64()
	if err != nil {
		return 0, err
	}
	if v < lo || v > hi {
		return 0, fmt.Errorf("%d out of [%d, %d]", v, lo, hi)
	}
	return v, nil
}

// hash reads a block hash: an integer (any sign, 64 bits) or bytes. ok is false for nil.
func (r *refReader) hash() (h uint64, ok bool, err error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == msgpcode.Nil:
		_, err = r.br.ReadByte()
		return 0, false, err
	case c == msgpcode.Uint64:
		h, err = r.d.DecodeUint64()
		return h, err == nil, err
	case isInt(c):
		v, err := r.d.DecodeInt64()
		return uint64(v), err == nil, err
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		p, err := r.bytes(maxString)
		if err != nil {
			return 0, false, err
		}
		return foldHash(p), true, nil
	}
	return 0, false, fmt.Errorf("want a block hash, got code %#x", c)
}

// present skips one value and reports whether it was anything but nil.
func (r *refReader) present() (bool, error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		_, err = r.br.ReadByte()
		return false, err
	}
	return true, r.skip(1)
}

// extraKeys reads extra_keys, nil (ok false) or an array with an entry per block, each nil
// (0) or the block's keys, folded by canon.
func (r *refReader) extraKeys() (out []uint64, ok bool, err error) {
	kind, n, err := r.head(maxHashes)
	if err != nil || kind == null {
		return nil, false, err
	}
	if kind != array {
		return nil, false, errors.New("extra_keys is not an array")
	}
	out = make([]uint64, 0, n)
	for range n {
		c, err := r.d.PeekCode()
		if err != nil {
			return nil, false, err
		}
		if c == msgpcode.Nil {
			_, _ = r.br.ReadByte()
			out = append(out, 0)
			continue
		}
		var cn canon
		if err := r.canonValue(&cn, 1); err != nil {
			return nil, false, err
		}
		out = append(out, cn.sum())
	}
	return out, true, nil
}

// canonValue reads one value into c through the msgpack decoder's typed calls.
func (r *refReader) canonValue(c *canon, depth int) error {
	if depth > maxDepth {
		return errors.New("nested too deep")
	}
	kind, n, err := r.head(math.MaxInt32)
	if err != nil {
		return err
	}
	switch kind {
	case null:
		c.null()
		return nil
	case array:
		c.array(n)
	case mapping:
		c.mapping(n)
		n *= 2
	}
	if kind != other {
		for range n {
			if err := r.canonValue(c, depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	code, err := r.d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case code == msgpcode.Uint64:
		v, err := r.d.DecodeUint64()
		c.integer(v)
		return err
	case isInt(code):
		v, err := r.d.DecodeInt64()
		c.integer(uint64(v))
		return err
	case msgpcode.IsString(code):
		p, err := r.bytes(math.MaxInt32)
		c.strBytes(p)
		return err
	case msgpcode.IsBin(code):
		p, err := r.bytes(math.MaxInt32)
		c.bin(p)
		return err
	case code == msgpcode.True || code == msgpcode.False:
		v, err := r.d.DecodeBool()
		c.boolean(v)
		return err
	case code == msgpcode.Float:
		v, err := r.d.DecodeFloat32()
		c.float(float64(v))
		return err
	case code == msgpcode.Double:
		v, err := r.d.DecodeFloat64()
		c.float(v)
		return err
	case code >= msgpcode.FixExt1 && code <= msgpcode.FixExt16 || code == msgpcode.Ext8 || code == msgpcode.Ext16 || code == msgpcode.Ext32:
		id, n, err := r.d.DecodeExtHeader()
		if err != nil {
			return err
		}
		if n < 0 || n > r.br.Len() {
			return fmt.Errorf("claims %d bytes with %d left", n, r.br.Len())
		}
		p := make([]byte, n)
		if _, err := io.ReadFull(r.br, p); err != nil {
			return err
		}
		c.ext(id, p)
		return nil
	}
	return fmt.Errorf("unknown code %#x", code)
}

// optInt reads nil, as 0, or an integer in [0, 2^31).
func (r *refReader) optInt() (int64, error) {
	c, err := r.d.PeekCode()
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Nil {
		_, err = r.br.ReadByte()
		return 0, err
	}
	return r.int(0, math.MaxInt32)
}

func (r *refReader) hashes() ([]uint64, error) {
	kind, n, err := r.head(maxHashes)
	if err != nil {
		return nil, err
	}
	if kind == null {
		return []uint64{}, nil // no blocks; harmless, so not worth dropping the message
	}
	if kind != array {
		return nil, errors.New("block_hashes is not an array")
	}
	out := make([]uint64, 0, n)
	pos := r.pos()
	for range n {
		if v, _, k := rawInt(r.p[pos:]); k > 0 {
			out = append(out, v)
			pos += k
			continue
		}
		r.seek(pos) // bytes, or no hash at all
		h, ok, err := r.hash()
		pos = r.pos()
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, errors.New("a block hash is nil")
		}
		out = append(out, h)
	}
	r.seek(pos)
	return out, nil
}

func (r *refReader) tokens() ([]uint32, error) {
	kind, n, err := r.head(maxTokens)
	if err != nil {
		return nil, err
	}
	if kind != array {
		return nil, errors.New("token_ids is not an array")
	}
	out := make([]uint32, 0, n)
	pos := r.pos()
	for range n {
		v, unsigned, k := rawInt(r.p[pos:])
		if k > 0 && (unsigned && v <= math.MaxUint32 || !unsigned && int64(v) >= 0 && int64(v) <= math.MaxUint32) {
			out = append(out, uint32(v))
			pos += k
			continue
		}
		r.seek(pos) // not a token id: the decoder says what is wrong
		iv, err := r.int(0, math.MaxUint32)
		if err != nil {
			return nil, fmt.Errorf("token id: %w", err)
		}
		out = append(out, uint32(iv))
		pos = r.pos()
	}
	r.seek(pos)
	return out, nil
}

func (r *refReader) batch() (Batch, error) {
	kind, n, err := r.head(8)
	if err != nil {
		return Batch{}, err
	}
	var b Batch
	var sawEvents bool
	field := func(name string) error {
		switch name {
		case "events":
			sawEvents = true
			return r.events(&b)
		case "data_parallel_rank":
			c, err := r.d.PeekCode()
			if err != nil {
				return err
			}
			if c == msgpcode.Nil {
				_, err = r.br.ReadByte()
				return err
			}
			v, err := r.int(0, math.MaxUint16)
			b.Rank = int(v)
			return err
		}
		return r.skip(1)
	}
	switch kind {
	case array:
		if n < 2 {
			return Batch{}, fmt.Errorf("batch has %d fields, want timestamp and events", n)
		}
		for i, name := range []string{"ts", "events", "data_parallel_rank"} {
			if i >= n {
				break
			}
			if err := field(name); err != nil {
				return Batch{}, fmt.Errorf("%s: %w", name, err)
			}
		}
		for range n - 3 {
			if err := r.skip(1); err != nil {
				return Batch{}, err
			}
		}
	case mapping:
		for range n {
			k, err := r.str()
			if err != nil {
				return Batch{}, fmt.Errorf("batch key: %w", err)
			}
			if err := field(k); err != nil {
				return Batch{}, fmt.Errorf("%s: %w", k, err)
			}
		}
	default:
		return Batch{}, errors.New("batch is neither an array nor a map")
	}
	if !sawEvents {
		return Batch{}, errors.New("batch has no events")
	}
	return b, nil
}

func (r *refReader) events(b *Batch) error {
	kind, n, err := r.head(maxEvents)
	if err != nil {
		return err
	}
	if kind != array {
		return errors.New("events is not an array")
	}
	b.Events = make([]Event, 0, n)
	for range n {
		e, known, err := r.event()
		if err != nil {
			return err
		}
		switch {
		case !known:
			b.Unknown++
		case !e.valid():
			b.Malformed++
		default:
			b.Events = append(b.Events, e)
		}
	}
	return nil
}

// The positional fields of the array form, after the tag, by msgspec's field order.
var (
	refStoredFields = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
		"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
	refRemovedFields = []string{"block_hashes", "medium", "group_idx"}
)

// event reads one event. known is false for an unknown tag, whose fields are skipped; an
// error means the message cannot be read further.
func (r *refReader) event() (e Event, known bool, err error) {
	var ks keysSeen
	defer func() { e.MissingKeys = ks.loraID && !ks.loraName || ks.loraName && !ks.extra }()
	kind, n, err := r.head(64)
	if err != nil {
		return Event{}, false, err
	}
	switch kind {
	case array:
		if n == 0 {
			return Event{}, false, errors.New("event is an empty array")
		}
		tag, err := r.str()
		if err != nil {
			return Event{}, false, fmt.Errorf("event tag: %w", err)
		}
		e.Kind = kindOf([]byte(tag))
		var names []string
		switch e.Kind {
		case BlockStored:
			names = refStoredFields
			if n-1 < 4 {
				return Event{}, false, fmt.Errorf("BlockStored has %d fields, want at least 4", n-1)
			}
		case BlockRemoved:
			names = refRemovedFields
			if n-1 < 1 {
				return Event{}, false, errors.New("BlockRemoved has no block_hashes")
			}
		}
		for i := range n - 1 {
			name := ""
			if i < len(names) {
				name = names[i]
			}
			if err := r.eventField(&e, &ks, name); err != nil {
				return Event{}, false, fmt.Errorf("%s: %w", tag, err)
			}
		}
	case mapping:
		for range n {
			k, err := r.str()
			if err != nil {
				return Event{}, false, fmt.Errorf("event key: %w", err)
			}
			if k == "type" {
				tag, err := r.str()
				if err != nil {
					return Event{}, false, fmt.Errorf("event type: %w", err)
				}
				e.Kind = kindOf([]byte(tag))
				continue
			}
			if err := r.eventField(&e, &ks, k); err != nil {
				return Event{}, false, fmt.Errorf("%s: %w", k, err)
			}
		}
	default:
		return Event{}, false, errors.New("event is neither an array nor a map")
	}
	return e, e.Kind != 0, nil
}

func (r *refReader) eventField(e *Event, ks *keysSeen, name string) error {
	var err error
	switch name {
	case "block_hashes":
		e.Hashes, err = r.hashes()
	case "parent_block_hash":
		e.Parent, e.HasParent, err = r.hash()
		e.HasParent = e.HasParent && e.Parent != 0
	case "token_ids":
		e.Tokens, err = r.tokens()
	case "block_size":
		var v int64
		v, err = r.int(0, math.MaxInt32)
		e.BlockSize = int(v)
	case "medium":
		e.Medium, err = r.str()
	case "lora_id":
		var set bool
		set, err = r.present()
		ks.loraID = ks.loraID || set
	case "lora_name":
		var name string
		name, err = r.str()
		ks.loraName = ks.loraName || name != ""
	case "extra_keys":
		e.Extra, ks.extra, err = r.extraKeys()
	case "group_idx":
		var v int64
		v, err = r.optInt()
		e.Group = int32(v)
	case "kv_cache_spec_kind":
		var kind string
		kind, err = r.str()
		e.Attention = attentionOf([]byte(kind))
	case "kv_cache_spec_sliding_window":
		var v int64
		v, err = r.optInt()
		e.Window = int(v)
	default:
		err = r.skip(1)
	}
	return err
}

// BenchmarkDecodeBatch decodes a message as vLLM publishes one for a 4,096-token prompt
// (256 blocks of 16 token ids, in msgspec's encoding) and the eviction of 16 blocks, with
// a Decoder kept from message to message and with refDecodeBatch.
func BenchmarkDecodeBatch(b *testing.B) {
	hashes := make([]uint64, 256)
	for i := range hashes {
		hashes[i] = 1<<40 + uint64(i)
	}
	tokens := make([]uint32, 256*16)
	for i := range tokens {
		tokens[i] = uint32(i*7919) % 128_000
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode([]any{1733000000.5, []any{stored(hashes, nil, tokens, 16), removed(hashes[:16]...)}, 0}); err != nil {
		b.Fatal(err)
	}
	p := buf.Bytes()
	var d Decoder
	for _, c := range []struct {
		name   string
		decode func([]byte) (Batch, error)
	}{{"decoder", d.DecodeBatch}, {"reference", refDecodeBatch}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.decode(p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*(len(hashes)+16)), "ns/block")
		})
	}
}
