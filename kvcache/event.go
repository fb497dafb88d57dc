package kvcache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"
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
	// Keyed is set when the engine hashed the blocks with more than their tokens (a LoRA
	// adapter, extra keys: a cache_salt, multimodal inputs): the same token ids under other
	// keys are other KV, which a request's tokens alone cannot tell apart.
	Keyed bool
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
// in the batch; anything else wrong drops the whole message with a *DecodeError.
func DecodeMessage(frames [][]byte) (Message, error) {
	if len(frames) != 3 || len(frames[1]) != 8 {
		return Message{}, &DecodeError{ReasonFrames, fmt.Errorf("want 3 frames with an 8-byte sequence, got %d", len(frames))}
	}
	b, err := DecodeBatch(frames[2])
	if err != nil {
		return Message{}, err
	}
	return Message{Topic: string(frames[0]), Seq: binary.BigEndian.Uint64(frames[1]), Batch: b}, nil
}

// DecodeBatch decodes a payload: [timestamp, [events], data_parallel_rank] (the rank may be
// left out), or the same as a map {"ts", "events", "data_parallel_rank"}. Events are arrays
// with the tag first (vLLM before PR #42892, SGLang) or maps with a "type" key.
func DecodeBatch(payload []byte) (Batch, error) {
	r := newReader(payload)
	b, err := r.batch()
	if err == nil && r.br.Len() != 0 {
		err = errors.New("trailing bytes after the batch")
	}
	if err != nil {
		return Batch{}, &DecodeError{ReasonDecode, err}
	}
	return b, nil
}

type reader struct {
	// p is the whole payload, which br reads: the arrays of integers are read from it
	// directly (rawInt), the decoder told where they end.
	p  []byte
	br *bytes.Reader
	d  *msgpack.Decoder
}

func newReader(p []byte) *reader {
	br := bytes.NewReader(p)
	// A bytes.Reader is an io.ByteScanner, so the decoder reads it directly, unbuffered:
	// br.Len() is what is left, which bounds every length the payload claims.
	return &reader{p: p, br: br, d: msgpack.NewDecoder(br)}
}

// pos is where the decoder is in p.
func (r *reader) pos() int { return len(r.p) - r.br.Len() }

// seek moves the decoder to pos in p.
func (r *reader) seek(pos int) { _, _ = r.br.Seek(int64(pos), io.SeekStart) }

// rawInt reads the integer at the start of p, as the decoder would, without it: the token
// ids and block hashes of a message are nearly all of it, and the decoder's calls per value
// cost more than the message's events take to apply. n is the bytes it takes, 0 when p does
// not start with a whole integer (the decoder then says what it is). v is the value as an
// int64 would hold it, except after the uint64 code (unsigned is then set), whose values
// above the int64 range a hash may take.
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

// head reads an array's or map's length, checked against the bytes left (every element
// takes at least one) and limit.
func (r *reader) head(limit int) (container, int, error) {
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
func (r *reader) bytes(limit int) ([]byte, error) {
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
func (r *reader) str() (string, error) {
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
func (r *reader) int(lo, hi int64) (int64, error) {
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

// anyPresent reads extra_keys, nil or an array with an entry per block, each nil or the
// block's keys, and reports whether any block has keys.
func (r *reader) anyPresent() (bool, error) {
	kind, n, err := r.head(maxHashes)
	if err != nil || kind == null {
		return false, err
	}
	if kind != array {
		return false, errors.New("extra_keys is not an array")
	}
	found := false
	for range n {
		set, err := r.present()
		if err != nil {
			return false, err
		}
		found = found || set
	}
	return found, nil
}

func (r *reader) hashes() ([]uint64, error) {
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

func (r *reader) tokens() ([]uint32, error) {
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

func (r *reader) batch() (Batch, error) {
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

func (r *reader) events(b *Batch) error {
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

// valid checks what the decoder can of the stored blocks: their token ids fill them
// exactly, at the given block size or, without one, at some size.
func (e *Event) valid() bool {
	if e.Kind != BlockStored {
		return true
	}
	if len(e.Hashes) == 0 || e.BlockSize > maxBlockSize {
		return false
	}
	if e.BlockSize == 0 {
		return len(e.Tokens) > 0 && len(e.Tokens)%len(e.Hashes) == 0
	}
	return len(e.Tokens) == len(e.Hashes)*e.BlockSize
}

func kindOf(tag string) Kind {
	switch tag {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

// The positional fields of the array form, after the tag, by msgspec's field order.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"}
	removedFields = []string{"block_hashes", "medium"}
)

// event reads one event. known is false for an unknown tag, whose fields are skipped; an
// error means the message cannot be read further.
func (r *reader) event() (e Event, known bool, err error) {
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
		e.Kind = kindOf(tag)
		var names []string
		switch e.Kind {
		case BlockStored:
			names = storedFields
			if n-1 < 4 {
				return Event{}, false, fmt.Errorf("BlockStored has %d fields, want at least 4", n-1)
			}
		case BlockRemoved:
			names = removedFields
			if n-1 < 1 {
				return Event{}, false, errors.New("BlockRemoved has no block_hashes")
			}
		}
		for i := range n - 1 {
			name := ""
			if i < len(names) {
				name = names[i]
			}
			if err := r.eventField(&e, name); err != nil {
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
				e.Kind = kindOf(tag)
				continue
			}
			if err := r.eventField(&e, k); err != nil {
				return Event{}, false, fmt.Errorf("%s: %w", k, err)
			}
		}
	default:
		return Event{}, false, errors.New("event is neither an array nor a map")
	}
	return e, e.Kind != 0, nil
}

func (r *reader) eventField(e *Event, name string) error {
	var err error
	switch name {
	case "block_hashes":
		e.Hashes, err = r.hashes()
	case "parent_block_hash":
		e.Parent, e.HasParent, err = r.hash()
	case "token_ids":
		e.Tokens, err = r.tokens()
	case "block_size":
		var v int64
		v, err = r.int(0, math.MaxInt32)
		e.BlockSize = int(v)
	case "medium":
		e.Medium, err = r.str()
	case "lora_id", "lora_name":
		var set bool
		set, err = r.present()
		e.Keyed = e.Keyed || set
	case "extra_keys":
		var set bool
		set, err = r.anyPresent()
		e.Keyed = e.Keyed || set
	default:
		err = r.skip(1)
	}
	return err
}
