package kvcache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Kind is what a KV event says happened to an engine's prefix cache.
type Kind uint8

// The kinds of KV events, by vLLM's class names.
const (
	// BlockStored: full blocks were computed and are cached.
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks were evicted.
	BlockRemoved
	// AllBlocksCleared: the whole cache was reset.
	AllBlocksCleared
)

// String is the kind as the metrics' type label has it.
func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "block_stored"
	case BlockRemoved:
		return "block_removed"
	case AllBlocksCleared:
		return "all_blocks_cleared"
	}
	return "unknown"
}

// Event is one decoded KV event.
type Event struct {
	Kind Kind
	// Hashes are the engine's block hashes (BlockStored, BlockRemoved), each folded to 64
	// bits: an integer as is, bytes by their last 8 (vLLM's uint64 form) or, when longer, by
	// a hash of them. They key only the engine's own blocks, so the fold need not match any
	// engine's.
	Hashes []uint64
	// Parent is the engine's hash of the block before the first one stored; HasParent is
	// false for blocks that start a prompt.
	Parent    uint64
	HasParent bool
	// Tokens are the token ids of the stored blocks, BlockSize per block.
	Tokens []uint32
	// BlockSize is the engine's block size; 0 when the event does not give it, for the
	// index's own to apply.
	BlockSize int
	// Medium is where the blocks live ("GPU", "CPU", ...); empty when not given.
	Medium string
	// Extra are the stored blocks' extra keys (extra_keys: the LoRA name, multimodal items,
	// the cache_salt, prompt embeddings' hashes), one per hash, each folded to 64 bits, 0 for
	// a block without any; nil when the event gives none.
	Extra []uint64
	// MissingKeys is set when the engine hashed the blocks with keys the event does not
	// give: a lora_id without a lora_name (SGLang, vLLM before lora_name), a lora_name
	// without extra_keys (vLLM before extra_keys, which may have salted them too). The same
	// token ids under other keys are other KV, which the index cannot tell apart.
	MissingKeys bool
	// Group is the KV cache group the blocks are of (group_idx): 0 when not given.
	Group int32
	// Attention is the kind of the group's layers (BlockStored's kv_cache_spec_kind),
	// AttentionFull when not given.
	Attention AttentionKind
	// Window is the group's sliding window in tokens (kv_cache_spec_sliding_window), 0 when
	// not given.
	Window int
}

// Batch is one message's payload.
type Batch struct {
	Events []Event
	// Rank is the engine's data parallel rank, 0 when not given.
	Rank int
	// Unknown counts events skipped for a tag this decoder does not know; Malformed counts
	// events skipped for fields that cannot be what they claim (token ids that do not fill
	// the blocks, a block size out of range).
	Unknown, Malformed int
}

// Message is one ZMQ message of an engine's publisher.
type Message struct {
	Topic string
	Seq   uint64
	Batch Batch
}

// Limits on what one message may claim, so that a hostile or broken publisher cannot make
// the decoder allocate more than its message's size suggests or recurse without bound. They
// are far above what an engine sends: a BlockStored covers one request's new blocks, at most
// its context length in tokens.
const (
	maxEvents    = 1 << 16
	maxHashes    = 1 << 17
	maxTokens    = 1 << 21
	maxBlockSize = 1 << 16
	maxDepth     = 16
	maxString    = 1 << 10
)

// DecodeError is why a message was dropped; Reason is the metrics' reason label.
type DecodeError struct {
	Reason string
	Err    error
}

func (e *DecodeError) Error() string { return "kv event: " + e.Reason + ": " + e.Err.Error() }
func (e *DecodeError) Unwrap() error { return e.Err }

// The reasons a whole message is dropped.
const (
	ReasonFrames = "frames" // not [topic, 8-byte sequence, payload]
	ReasonDecode = "decode" // the payload is not a batch of events
)

// DecodeMessage decodes one message's frames: [topic, sequence as 8 bytes big-endian,
// msgpack payload]. An event with an unknown tag or impossible fields is skipped and counted
// in the batch; anything else wrong drops the whole message with a *DecodeError. The
// message is the caller's to keep; a listener decoding message after message reuses a
// Decoder instead.
func DecodeMessage(frames [][]byte) (Message, error) {
	var d Decoder
	return d.DecodeMessage(frames)
}

// DecodeBatch decodes a payload: [timestamp, [events], data_parallel_rank] (the rank may be
// left out), or the same as a map {"ts", "events", "data_parallel_rank"}. Events are arrays
// with the tag first (vLLM before PR #42892, SGLang) or maps with a "type" key. The batch is
// the caller's to keep.
func DecodeBatch(payload []byte) (Batch, error) {
	var d Decoder
	return d.DecodeBatch(payload)
}

// Decoder decodes messages as DecodeMessage does into memory it keeps from one message to
// the next: a listener's stream of messages, each decoded, applied and dropped, costs no
// allocation but the topic's. What a call returns (the events, their hashes and token ids)
// is valid until the next call. The zero value is ready to use; a Decoder is not safe for
// concurrent use.
type Decoder struct {
	events []Event
	// spans are where each event's hashes and token ids are in hashes and tokens, which
	// may move as they grow: the events' slices are set from them once all are decoded.
	spans  []span
	hashes []uint64
	tokens []uint32
	extras []uint64
}

// span is one event's part of the Decoder's hashes, tokens and extra keys; extra is set
// when the event gives extra keys.
type span struct {
	h0, h1, t0, t1, e0, e1 int32
	extra                  bool
}

// keepTokens is the most token ids a Decoder's buffer keeps after a message: a message
// longer than any engine's context (a broken or hostile publisher's) does not leave its
// memory behind.
const keepTokens = 1 << 20

// DecodeMessage decodes one message's frames, as the function DecodeMessage does.
func (d *Decoder) DecodeMessage(frames [][]byte) (Message, error) {
	if len(frames) != 3 || len(frames[1]) != 8 {
		return Message{}, &DecodeError{ReasonFrames, fmt.Errorf("want 3 frames with an 8-byte sequence, got %d", len(frames))}
	}
	b, err := d.DecodeBatch(frames[2])
	if err != nil {
		return Message{}, err
	}
	return Message{Topic: string(frames[0]), Seq: binary.BigEndian.Uint64(frames[1]), Batch: b}, nil
}

// DecodeBatch decodes a payload, as the function DecodeBatch does.
func (d *Decoder) DecodeBatch(payload []byte) (Batch, error) {
	if cap(d.tokens) > keepTokens {
		d.events, d.spans, d.hashes, d.tokens, d.extras = nil, nil, nil, nil, nil
	}
	r := reader{p: payload, d: d}
	d.events, d.spans, d.hashes, d.tokens, d.extras = d.events[:0], d.spans[:0], d.hashes[:0], d.tokens[:0], d.extras[:0]
	b, err := r.batch()
	if err == nil && r.i != len(r.p) {
		err = errors.New("trailing bytes after the batch")
	}
	if err != nil {
		return Batch{}, &DecodeError{ReasonDecode, err}
	}
	for i := range d.events {
		d.events[i].Hashes, d.events[i].Tokens, d.events[i].Extra = d.slices(d.spans[i])
	}
	b.Events = d.events
	return b, nil
}

// slices are s's hashes, token ids and extra keys (nil when it gives none), capped so that
// an append to one cannot reach the next event's.
func (d *Decoder) slices(s span) ([]uint64, []uint32, []uint64) {
	var extra []uint64
	if s.extra {
		extra = d.extras[s.e0:s.e1:s.e1]
		if extra == nil {
			extra = []uint64{}
		}
	}
	return d.hashes[s.h0:s.h1:s.h1], d.tokens[s.t0:s.t1:s.t1], extra
}

// reader reads one payload, p from i on, by hand: a message is nearly all block hashes and
// token ids, each a value or two of bytes, and a general decoder's calls per value cost
// more than applying its events does. Every length the payload claims is checked against
// the bytes left (each element takes at least one), so what it makes its Decoder hold is
// bounded by the payload's size, as well as by the limits above.
type reader struct {
	p []byte
	i int
	d *Decoder
}

// rawInt reads the integer at the start of p. n is the bytes it takes, 0 when p does not
// start with a whole integer. v is the value as an int64 would hold it, except after the
// uint64 code (unsigned is then set), whose values above the int64 range a hash may take.
func rawInt(p []byte) (v uint64, unsigned bool, n int) {
	if len(p) == 0 {
		return 0, false, 0
	}
	c := p[0]
	switch {
	case c <= 0x7f: // positive fixint
		return uint64(c), false, 1
	case c >= 0xe0: // negative fixint
		return uint64(int64(int8(c))), false, 1
	}
	size := 0
	switch c {
	case msgpcode.Uint8, msgpcode.Int8:
		size = 1
	case msgpcode.Uint16, msgpcode.Int16:
		size = 2
	case msgpcode.Uint32, msgpcode.Int32:
		size = 4
	case msgpcode.Uint64, msgpcode.Int64:
		size = 8
	default:
		return 0, false, 0
	}
	if len(p) < 1+size {
		return 0, false, 0
	}
	b := p[1 : 1+size]
	switch c {
	case msgpcode.Uint8:
		v = uint64(b[0])
	case msgpcode.Uint16:
		v = uint64(binary.BigEndian.Uint16(b))
	case msgpcode.Uint32:
		v = uint64(binary.BigEndian.Uint32(b))
	case msgpcode.Uint64:
		return binary.BigEndian.Uint64(b), true, 9
	case msgpcode.Int8:
		v = uint64(int64(int8(b[0])))
	case msgpcode.Int16:
		v = uint64(int64(int16(binary.BigEndian.Uint16(b))))
	case msgpcode.Int32:
		v = uint64(int64(int32(binary.BigEndian.Uint32(b))))
	case msgpcode.Int64:
		v = binary.BigEndian.Uint64(b)
	}
	return v, false, 1 + size
}

type container uint8

const (
	other container = iota
	array
	mapping
	null
)

// errShort is a value cut off by the payload's end.
var errShort = io.ErrUnexpectedEOF

// peek returns the next value's code.
func (r *reader) peek() (byte, error) {
	if r.i >= len(r.p) {
		return 0, errShort
	}
	return r.p[r.i], nil
}

// take returns the next n bytes.
func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || n > len(r.p)-r.i {
		return nil, fmt.Errorf("claims %d bytes with %d left", n, len(r.p)-r.i)
	}
	b := r.p[r.i : r.i+n : r.i+n]
	r.i += n
	return b, nil
}

// length reads a big-endian length of size bytes (1, 2 or 4).
func (r *reader) length(size int) (int, error) {
	b, err := r.take(size)
	if err != nil {
		return 0, err
	}
	switch size {
	case 1:
		return int(b[0]), nil
	case 2:
		return int(binary.BigEndian.Uint16(b)), nil
	}
	return int(binary.BigEndian.Uint32(b)), nil
}

// head reads an array's or map's length, checked against the bytes left (every element
// takes at least one) and limit. A nil is read as null; anything else is left unread.
func (r *reader) head(limit int) (container, int, error) {
	c, err := r.peek()
	if err != nil {
		return other, 0, err
	}
	var kind container
	var n int
	switch {
	case c == msgpcode.Nil:
		r.i++
		return null, 0, nil
	case msgpcode.IsFixedArray(c):
		kind, n = array, int(c&0x0f)
		r.i++
	case msgpcode.IsFixedMap(c):
		kind, n = mapping, int(c&0x0f)
		r.i++
	case c == msgpcode.Array16 || c == msgpcode.Map16 || c == msgpcode.Array32 || c == msgpcode.Map32:
		kind = array
		if c == msgpcode.Map16 || c == msgpcode.Map32 {
			kind = mapping
		}
		size := 2
		if c == msgpcode.Array32 || c == msgpcode.Map32 {
			size = 4
		}
		r.i++
		n, err = r.length(size)
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
	if left := len(r.p) - r.i; n > limit || n*per > left {
		return other, 0, fmt.Errorf("claims %d elements with %d bytes left (limit %d)", n, left, limit)
	}
	return kind, n, nil
}

// strLen reads a str's or bin's code and length, and reports whether c is one.
func (r *reader) strLen(c byte) (n int, ok bool, err error) {
	switch {
	case msgpcode.IsFixedString(c):
		r.i++
		return int(c & 0x1f), true, nil
	case c == msgpcode.Str8 || c == msgpcode.Bin8:
		r.i++
		n, err = r.length(1)
	case c == msgpcode.Str16 || c == msgpcode.Bin16:
		r.i++
		n, err = r.length(2)
	case c == msgpcode.Str32 || c == msgpcode.Bin32:
		r.i++
		n, err = r.length(4)
	default:
		return 0, false, nil
	}
	return n, true, err
}

// skip skips one value of any type, nested at most maxDepth deep.
func (r *reader) skip(depth int) error {
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
	case array, mapping:
		if kind == mapping {
			n *= 2
		}
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	}
	c := r.p[r.i] // head saw it
	if n, ok, err := r.strLen(c); ok {
		if err != nil {
			return err
		}
		_, err = r.take(n)
		return err
	}
	r.i++
	size := 0
	switch {
	case msgpcode.IsFixedNum(c), c == msgpcode.False, c == msgpcode.True:
	case c == msgpcode.Uint8, c == msgpcode.Int8:
		size = 1
	case c == msgpcode.Uint16, c == msgpcode.Int16:
		size = 2
	case c == msgpcode.Uint32, c == msgpcode.Int32, c == msgpcode.Float:
		size = 4
	case c == msgpcode.Uint64, c == msgpcode.Int64, c == msgpcode.Double:
		size = 8
	case c >= msgpcode.FixExt1 && c <= msgpcode.FixExt16: // a type byte, then 1 to 16 bytes
		size = 1 + 1<<(c-msgpcode.FixExt1)
	case c == msgpcode.Ext8, c == msgpcode.Ext16, c == msgpcode.Ext32:
		n, err := r.length(1 << (c - msgpcode.Ext8))
		if err != nil {
			return err
		}
		size = n + 1
	default:
		return fmt.Errorf("unknown code %#x", c)
	}
	_, err = r.take(size)
	return err
}

// str reads a str or bin, at most maxString bytes, or nil (as none); anything else is an
// error. The bytes are the payload's own.
func (r *reader) str() ([]byte, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	if c == msgpcode.Nil {
		r.i++
		return nil, nil
	}
	n, ok, err := r.strLen(c)
	if !ok {
		return nil, fmt.Errorf("want a string, got code %#x", c)
	}
	if err != nil {
		return nil, err
	}
	if n > maxString {
		return nil, fmt.Errorf("claims %d bytes (limit %d)", n, maxString)
	}
	return r.take(n)
}

// int reads an integer in [lo, hi], lo at least 0.
func (r *reader) int(lo, hi int64) (int64, error) {
	v, unsigned, n := rawInt(r.p[r.i:])
	if n == 0 {
		return 0, r.notInt()
	}
	if unsigned && v > uint64(hi) || !unsigned && (int64(v) < lo || int64(v) > hi) {
		return 0, fmt.Errorf("%d out of [%d, %d]", v, lo, hi)
	}
	r.i += n
	return int64(v), nil
}

// notInt is why what rawInt could not read is no integer.
func (r *reader) notInt() error {
	c, err := r.peek()
	switch {
	case err != nil:
		return err
	case isInt(c):
		return errShort
	}
	return fmt.Errorf("want an integer, got code %#x", c)
}

func isInt(c byte) bool {
	if msgpcode.IsFixedNum(c) {
		return true
	}
	switch c {
	case msgpcode.Uint8, msgpcode.Uint16, msgpcode.Uint32, msgpcode.Uint64,
		msgpcode.Int8, msgpcode.Int16, msgpcode.Int32, msgpcode.Int64:
		return true
	}
	return false
}

// hash reads a block hash: an integer (any sign, 64 bits) or bytes. ok is false for nil.
func (r *reader) hash() (h uint64, ok bool, err error) {
	if v, _, n := rawInt(r.p[r.i:]); n > 0 {
		r.i += n
		return v, true, nil
	}
	c, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == msgpcode.Nil:
		r.i++
		return 0, false, nil
	case isInt(c):
		return 0, false, errShort
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		p, err := r.str()
		if err != nil {
			return 0, false, err
		}
		return foldHash(p), true, nil
	}
	return 0, false, fmt.Errorf("want a block hash, got code %#x", c)
}

// noParent is a parent hash that names none: vLLM writes nil for the first block's parent, but
// some publishers write 0, which no block's hash is in practice. Taken for a parent, it would
// make every chain start at a block nobody stored, and the index drop it all.
const noParent = 0

// foldHash turns a hash given as bytes into 64 bits: vLLM's uint64 form is the digest's
// last 8 bytes, so bytes up to 8 long are read as that integer and longer ones hashed.
func foldHash(p []byte) uint64 {
	if len(p) <= 8 {
		var b [8]byte
		copy(b[8-len(p):], p)
		return binary.BigEndian.Uint64(b[:])
	}
	return xxhash.Sum64(p)
}

// present skips one value and reports whether it was anything but nil.
func (r *reader) present() (bool, error) {
	c, err := r.peek()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		r.i++
		return false, nil
	}
	return true, r.skip(1)
}

// extraKeys reads extra_keys, nil or an array with an entry per block, each nil or the
// block's keys (a tuple: the LoRA name, multimodal items, the cache_salt, ...), into the
// Decoder's extras, each folded by canon; ok is false for nil.
func (r *reader) extraKeys() (e0, e1 int32, ok bool, err error) {
	kind, n, err := r.head(maxHashes)
	if err != nil || kind == null {
		return 0, 0, false, err
	}
	if kind != array {
		return 0, 0, false, errors.New("extra_keys is not an array")
	}
	e0 = int32(len(r.d.extras))
	for range n {
		c, err := r.peek()
		if err != nil {
			return 0, 0, false, err
		}
		if c == msgpcode.Nil {
			r.i++
			r.d.extras = append(r.d.extras, 0)
			continue
		}
		var cn canon
		if err := r.canonValue(&cn, 1); err != nil {
			return 0, 0, false, err
		}
		r.d.extras = append(r.d.extras, cn.sum())
	}
	return e0, int32(len(r.d.extras)), true, nil
}

// canonValue reads one value of any type into c, nested at most maxDepth deep: the same
// value hashes alike whatever widths its encoder chose for its integers.
func (r *reader) canonValue(c *canon, depth int) error {
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
	case array, mapping:
		if kind == mapping {
			c.mapping(n)
			n *= 2
		} else {
			c.array(n)
		}
		for range n {
			if err := r.canonValue(c, depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	if v, _, size := rawInt(r.p[r.i:]); size > 0 {
		r.i += size
		c.integer(v)
		return nil
	}
	b := r.p[r.i] // head saw it
	if n, ok, err := r.strLen(b); ok {
		if err != nil {
			return err
		}
		p, err := r.take(n)
		if err != nil {
			return err
		}
		if msgpcode.IsBin(b) {
			c.bin(p)
		} else {
			c.strBytes(p)
		}
		return nil
	}
	switch {
	case b == msgpcode.False, b == msgpcode.True:
		r.i++
		c.boolean(b == msgpcode.True)
		return nil
	case b == msgpcode.Float:
		r.i++
		p, err := r.take(4)
		if err != nil {
			return err
		}
		c.float(float64(math.Float32frombits(binary.BigEndian.Uint32(p))))
		return nil
	case b == msgpcode.Double:
		r.i++
		p, err := r.take(8)
		if err != nil {
			return err
		}
		c.float(math.Float64frombits(binary.BigEndian.Uint64(p)))
		return nil
	case b >= msgpcode.FixExt1 && b <= msgpcode.FixExt16:
		r.i++
		p, err := r.take(1 + 1<<(b-msgpcode.FixExt1))
		if err != nil {
			return err
		}
		c.ext(int8(p[0]), p[1:])
		return nil
	case b == msgpcode.Ext8, b == msgpcode.Ext16, b == msgpcode.Ext32:
		r.i++
		n, err := r.length(1 << (b - msgpcode.Ext8))
		if err != nil {
			return err
		}
		p, err := r.take(n + 1)
		if err != nil {
			return err
		}
		c.ext(int8(p[0]), p[1:])
		return nil
	case isInt(b):
		return errShort
	}
	return fmt.Errorf("unknown code %#x", b)
}

// hashes reads block_hashes into the Decoder's hashes, and returns where they are.
func (r *reader) hashes() (h0, h1 int32, err error) {
	kind, n, err := r.head(maxHashes)
	if err != nil {
		return 0, 0, err
	}
	h0 = int32(len(r.d.hashes))
	if kind == null {
		return h0, h0, nil // no blocks; harmless, so not worth dropping the message
	}
	if kind != array {
		return 0, 0, errors.New("block_hashes is not an array")
	}
	for range n {
		h, ok, err := r.hash()
		if err != nil {
			return 0, 0, err
		}
		if !ok {
			return 0, 0, errors.New("a block hash is nil")
		}
		r.d.hashes = append(r.d.hashes, h)
	}
	return h0, int32(len(r.d.hashes)), nil
}

// tokens reads token_ids into the Decoder's tokens, and returns where they are.
func (r *reader) tokens() (t0, t1 int32, err error) {
	kind, n, err := r.head(maxTokens)
	if err != nil {
		return 0, 0, err
	}
	if kind != array {
		return 0, 0, errors.New("token_ids is not an array")
	}
	start := len(r.d.tokens)
	r.d.tokens = slices.Grow(r.d.tokens, n)[:start+n]
	out := r.d.tokens[start:]
	// The token ids below 2^32 that an engine sends, inline; anything else through int,
	// which says what is wrong with it.
	p, i := r.p, r.i
	for j := range out {
		if i+4 < len(p) { // room for the longest of the four
			switch c := p[i]; {
			case c <= 0x7f:
				out[j] = uint32(c)
				i++
				continue
			case c == msgpcode.Uint8:
				out[j] = uint32(p[i+1])
				i += 2
				continue
			case c == msgpcode.Uint16:
				out[j] = uint32(binary.BigEndian.Uint16(p[i+1:]))
				i += 3
				continue
			case c == msgpcode.Uint32:
				out[j] = binary.BigEndian.Uint32(p[i+1:])
				i += 5
				continue
			}
		}
		r.i = i
		v, err := r.int(0, math.MaxUint32)
		if err != nil {
			return 0, 0, fmt.Errorf("token id: %w", err)
		}
		out[j] = uint32(v)
		i = r.i
	}
	r.i = i
	return int32(start), int32(start + n), nil
}

func (r *reader) batch() (Batch, error) {
	kind, n, err := r.head(8)
	if err != nil {
		return Batch{}, err
	}
	var b Batch
	var sawEvents bool
	read := func(name string) error {
		switch name {
		case "events":
			sawEvents = true
			return r.events(&b)
		case "data_parallel_rank":
			c, err := r.peek()
			if err != nil {
				return err
			}
			if c == msgpcode.Nil {
				r.i++
				return nil
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
		for i, name := range [...]string{"ts", "events", "data_parallel_rank"} {
			if i >= n {
				break
			}
			if err := read(name); err != nil {
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
			if err := read(string(k)); err != nil {
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

// events reads the events into the Decoder's; a second list (a map with the key twice)
// takes the first's place, as a map's later value does.
func (r *reader) events(b *Batch) error {
	kind, n, err := r.head(maxEvents)
	if err != nil {
		return err
	}
	if kind != array {
		return errors.New("events is not an array")
	}
	d := r.d
	d.events, d.spans = slices.Grow(d.events[:0], n), slices.Grow(d.spans[:0], n)
	for range n {
		e, s, known, err := r.event()
		if err != nil {
			return err
		}
		e.Hashes, e.Tokens, e.Extra = d.slices(s)
		switch {
		case !known:
			b.Unknown++
		case !e.valid():
			b.Malformed++
		default:
			d.events = append(d.events, e)
			d.spans = append(d.spans, s)
		}
	}
	return nil
}

// valid checks what the decoder can of the stored blocks: their token ids fill them
// exactly, at the given block size or, without one, at some size, and there are as many
// extra keys as blocks. A group of a kind other than full attention may store fewer blocks
// than its token ids fill: vLLM skips the blocks out of a sliding window (null blocks) and
// publishes the token ids of the whole range, the hashes of the blocks it kept.
func (e *Event) valid() bool {
	if e.Kind != BlockStored {
		return true
	}
	if e.BlockSize > maxBlockSize || e.Extra != nil && len(e.Extra) != len(e.Hashes) {
		return false
	}
	if e.Attention != AttentionFull && e.BlockSize > 0 {
		return len(e.Tokens)%e.BlockSize == 0 && len(e.Hashes) <= len(e.Tokens)/e.BlockSize
	}
	if len(e.Hashes) == 0 {
		return false
	}
	if e.BlockSize == 0 {
		return len(e.Tokens) > 0 && len(e.Tokens)%len(e.Hashes) == 0
	}
	return len(e.Tokens) == len(e.Hashes)*e.BlockSize
}

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

// field is an event's field this decoder reads; the others it skips.
type field uint8

const (
	skipped field = iota
	blockHashes
	parentBlockHash
	tokenIDs
	blockSize
	loraID
	medium
	loraName
	extraKeys
	groupIdx
	specKind
	specWindow
)

// fieldOf is the field a map's key names.
func fieldOf(key []byte) field {
	switch string(key) {
	case "block_hashes":
		return blockHashes
	case "parent_block_hash":
		return parentBlockHash
	case "token_ids":
		return tokenIDs
	case "block_size":
		return blockSize
	case "lora_id":
		return loraID
	case "medium":
		return medium
	case "lora_name":
		return loraName
	case "extra_keys":
		return extraKeys
	case "group_idx":
		return groupIdx
	case "kv_cache_spec_kind":
		return specKind
	case "kv_cache_spec_sliding_window":
		return specWindow
	}
	return skipped
}

// The positional fields of the array form, after the tag, by msgspec's field order.
var (
	storedFields  = []field{blockHashes, parentBlockHash, tokenIDs, blockSize, loraID, medium, loraName, extraKeys, groupIdx, specKind, specWindow}
	removedFields = []field{blockHashes, medium, groupIdx}
)

// fieldNames are the fields' names, for errors.
var fieldNames = [...]string{"field", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
	"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}

// keysSeen is what an event says of the keys its blocks were hashed with, read field by
// field: whether it has a lora_id, a lora_name, extra_keys.
type keysSeen struct{ loraID, loraName, extra bool }

// missing is whether the blocks were hashed with keys the event does not give.
func (k keysSeen) missing() bool { return k.loraID && !k.loraName || k.loraName && !k.extra }

// event reads one event, its hashes and token ids into the Decoder's, where s says. known is
// false for an unknown tag, whose fields are skipped; an error means the message cannot be
// read further.
func (r *reader) event() (e Event, s span, known bool, err error) {
	var ks keysSeen
	defer func() { e.MissingKeys = ks.missing() }()
	kind, n, err := r.head(64)
	if err != nil {
		return Event{}, span{}, false, err
	}
	switch kind {
	case array:
		if n == 0 {
			return Event{}, span{}, false, errors.New("event is an empty array")
		}
		tag, err := r.str()
		if err != nil {
			return Event{}, span{}, false, fmt.Errorf("event tag: %w", err)
		}
		e.Kind = kindOf(tag)
		var fields []field
		switch e.Kind {
		case BlockStored:
			fields = storedFields
			if n-1 < 4 {
				return Event{}, span{}, false, fmt.Errorf("BlockStored has %d fields, want at least 4", n-1)
			}
		case BlockRemoved:
			fields = removedFields
			if n-1 < 1 {
				return Event{}, span{}, false, errors.New("BlockRemoved has no block_hashes")
			}
		}
		for i := range n - 1 {
			f := skipped
			if i < len(fields) {
				f = fields[i]
			}
			if err := r.eventField(&e, &s, &ks, f); err != nil {
				return Event{}, span{}, false, fmt.Errorf("%s: %s: %w", tag, fieldNames[f], err)
			}
		}
	case mapping:
		for range n {
			k, err := r.str()
			if err != nil {
				return Event{}, span{}, false, fmt.Errorf("event key: %w", err)
			}
			if string(k) == "type" {
				tag, err := r.str()
				if err != nil {
					return Event{}, span{}, false, fmt.Errorf("event type: %w", err)
				}
				e.Kind = kindOf(tag)
				continue
			}
			if err := r.eventField(&e, &s, &ks, fieldOf(k)); err != nil {
				return Event{}, span{}, false, fmt.Errorf("%s: %w", k, err)
			}
		}
	default:
		return Event{}, span{}, false, errors.New("event is neither an array nor a map")
	}
	return e, s, e.Kind != 0, nil
}

func (r *reader) eventField(e *Event, s *span, ks *keysSeen, f field) error {
	var err error
	switch f {
	case blockHashes:
		s.h0, s.h1, err = r.hashes()
	case parentBlockHash:
		e.Parent, e.HasParent, err = r.hash()
		e.HasParent = e.HasParent && e.Parent != noParent
	case tokenIDs:
		s.t0, s.t1, err = r.tokens()
	case blockSize:
		var v int64
		v, err = r.int(0, math.MaxInt32)
		e.BlockSize = int(v)
	case medium:
		var m []byte
		m, err = r.str()
		e.Medium = mediumString(m)
	case loraID:
		var set bool
		set, err = r.present()
		ks.loraID = ks.loraID || set
	case loraName:
		var name []byte
		if name, err = r.str(); err == nil && len(name) > 0 {
			ks.loraName = true
		}
	case extraKeys:
		s.e0, s.e1, s.extra, err = r.extraKeys()
		ks.extra = s.extra
	case groupIdx:
		var v int64
		if v, err = r.optInt(); err == nil {
			e.Group = int32(v)
		}
	case specKind:
		var kind []byte
		if kind, err = r.str(); err == nil {
			e.Attention = attentionOf(kind)
		}
	case specWindow:
		var v int64
		v, err = r.optInt()
		e.Window = int(v)
	default:
		err = r.skip(1)
	}
	return err
}

// optInt reads nil, as 0, or an integer in [0, 2^31).
func (r *reader) optInt() (int64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Nil {
		r.i++
		return 0, nil
	}
	return r.int(0, math.MaxInt32)
}

// mediumString is m as a string, without an allocation for the media engines name.
func mediumString(m []byte) string {
	switch string(m) {
	case "":
		return ""
	case TierGPU:
		return TierGPU
	case TierCPU:
		return TierCPU
	case "GPU":
		return "GPU"
	case "CPU":
		return "CPU"
	}
	return string(m)
}
