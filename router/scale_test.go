package router

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// BenchmarkRoutingAtScale builds the precise index of a large pool from the KV events its
// engines would publish, then picks engines for prompts with precise_cache_aware, and
// reports:
//
//   - pick-p99-us: the 99th percentile of one pick (the index's match of a 4,096-token
//     prompt and the policy's choice among every engine of the pool), over 2,000 picks;
//   - ingest-events/s: block events (each block a BlockStored or BlockRemoved names)
//     decoded from their msgpack payloads and applied to the index per second, on one core,
//     the messages of every engine interleaved as they arrive from its publisher, once
//     every engine's cache is full and it evicts as much as it stores (the rate while the
//     index is built from empty is logged beside it);
//   - bytes/pair: the heap the index takes, after a GC, per cached (block, engine) pair;
//   - fixed-p99-us, for scale: the 99th percentile of a fixed computation as long as the
//     pick's median, timed as many times right after the picks: the tail the machine alone
//     puts on work of that length.
//
// The pool: engines of 16-token blocks, each caching 4,096-token prompts; a prompt is a
// shared prefix (16 to 224 blocks) that 1 to 50 engines hold, then the engine's own suffix.
// Each engine stores a prompt as vLLM publishes it, its prefix in one BlockStored and its
// suffix in another naming the prefix's last block as parent, and evicts the last 16
// blocks of its previous prompt (BlockRemoved). The picks' prompts are a held prefix (or,
// one in 51, one no engine holds) and a suffix no engine holds.
//
// By default each engine holds 10,000 blocks, at 100 and 1,000 engines (10 million pairs
// at most, under a minute and 1 GB); PDPROXY_BENCH_SCALE=full holds 100,000 blocks each
// (100 million pairs at 1,000 engines: about 7 GB resident, 2 to 3 minutes), the size of an
// internet-scale pool; PDPROXY_BENCH_SCALE_BLOCKS sets another.
func BenchmarkRoutingAtScale(b *testing.B) {
	blocks := 10_000
	if os.Getenv("PDPROXY_BENCH_SCALE") == "full" {
		blocks = 100_000
	}
	if s := os.Getenv("PDPROXY_BENCH_SCALE_BLOCKS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 256 {
			b.Fatalf("PDPROXY_BENCH_SCALE_BLOCKS=%q: want a number of blocks per engine, at least 256", s)
		}
		blocks = n
	}
	for _, engines := range []int{100, 1000} {
		b.Run(fmt.Sprintf("engines=%d", engines), func(b *testing.B) {
			benchRoutingAtScale(b, engines, blocks)
		})
	}
}

// scaleBlock and scalePrompt are the pool's block size and prompt length in blocks.
const (
	scaleBlock  = 16
	scalePrompt = 4096 / scaleBlock
	// scaleEvict is how many blocks of its previous prompt an engine evicts per prompt.
	scaleEvict = 16
)

// scaleFleet is the pool's shared prefixes and which engines hold which.
type scaleFleet struct {
	// prefixLen is each prefix's length in blocks.
	prefixLen []int
	// held are the prefixes each engine holds, in the order it stores them.
	held [][]int32
}

// minHeld is the fewest prompts an engine holds.
func (f *scaleFleet) minHeld() int {
	n := math.MaxInt
	for _, h := range f.held {
		n = min(n, len(h))
	}
	return n
}

// newScaleFleet assigns prefixes to engines until each holds about blocks blocks.
func newScaleFleet(r *rand.Rand, engines, blocks int) *scaleFleet {
	perEngine := (blocks + scalePrompt - scaleEvict - 1) / (scalePrompt - scaleEvict)
	f := &scaleFleet{held: make([][]int32, engines)}
	open := make([]int, engines) // engines with room, shuffled in part below
	for i := range open {
		open[i] = i
	}
	for len(open) > 0 {
		d := int32(len(f.prefixLen))
		f.prefixLen = append(f.prefixLen, 16+r.IntN(209))
		k := min(1+r.IntN(50), len(open))
		for i := range k { // a partial shuffle: k distinct engines with room
			j := i + r.IntN(len(open)-i)
			open[i], open[j] = open[j], open[i]
			e := open[i]
			f.held[e] = append(f.held[e], d)
		}
		open = slices.DeleteFunc(open, func(e int) bool { return len(f.held[e]) >= perEngine })
	}
	return f
}

// fixedWork is the machine's own tail beside the picks': the 99th percentile of n timings
// of one fixed computation (arithmetic in registers, no memory, no allocation) whose median
// is about d. What it takes beyond d is time the goroutine was not running: other work of the
// machine, its interrupts, the runtime's.
func fixedWork(d time.Duration, n int) time.Duration {
	x := uint64(1)
	spin := func(iters int) time.Duration {
		start := time.Now()
		for range iters {
			x = x*6364136223846793005 + 1442695040888963407
		}
		return time.Since(start)
	}
	const probe = 10_000
	per := make([]time.Duration, 101)
	for i := range per {
		per[i] = spin(probe)
	}
	slices.Sort(per)
	iters := max(1, int(int64(d)*probe/max(1, int64(per[len(per)/2]))))
	durs := make([]time.Duration, n)
	for i := range durs {
		durs[i] = spin(iters)
	}
	slices.Sort(durs)
	fixedSink = x // the result is used: the loop stays
	return durs[len(durs)*99/100]
}

var fixedSink uint64

// prefixTokens writes prefix d's tokens: the same for every engine and every pick.
func prefixTokens(d int, n int, out []uint32) []uint32 {
	r := rand.New(rand.NewPCG(uint64(d), 0x9e3779b97f4a7c15))
	for range n {
		out = append(out, r.Uint32N(128_000))
	}
	return out
}

// suffixTokens appends n tokens no other prompt has (by seed).
func suffixTokens(seed uint64, n int, out []uint32) []uint32 {
	r := rand.New(rand.NewPCG(seed, 0xda942042e4dd58b5))
	for range n {
		out = append(out, r.Uint32N(128_000))
	}
	return out
}

func benchRoutingAtScale(b *testing.B, engines, blocks int) {
	r := rand.New(rand.NewPCG(42, uint64(engines)))
	f := newScaleFleet(r, engines, blocks)
	bs := testBackends(make([]int64, engines)...)
	for _, be := range bs {
		be.st.inflight.Store(int64(r.IntN(4)))
	}

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	index := kvcache.NewIndex(0, scaleBlock)
	index.SetMaxTotal(engines * (blocks + scalePrompt))
	build, steady := ingestScale(b, f, bs, index)

	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	pairs := 0
	for _, s := range index.Engines() {
		pairs += s.Blocks
	}
	if pairs < engines*blocks*9/10 {
		b.Fatalf("the index holds %d pairs, want about %d: events were refused", pairs, engines*blocks)
	}

	// The picks, each of a prompt of its own: one seen before would find its blocks, their
	// holders and its text in the processor's caches, as no request does.
	const picks = 2000
	prompts := make([][]uint32, picks)
	texts := make([]string, len(prompts))
	for i := range prompts {
		d := r.IntN(len(f.prefixLen) + len(f.prefixLen)/50) // one in 51 held by no engine
		var p []uint32
		if d < len(f.prefixLen) {
			p = prefixTokens(d, f.prefixLen[d]*scaleBlock, make([]uint32, 0, scalePrompt*scaleBlock))
		}
		prompts[i] = suffixTokens(uint64(1<<40+i), scalePrompt*scaleBlock-len(p), p)
		texts[i] = tokensText(prompts[i])
	}
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
	durs := make([]time.Duration, 0, picks)
	b.ResetTimer()
	for b.Loop() {
		for i := range picks {
			start := time.Now()
			p.Select(bs, Hint{Tokens: prompts[i], Text: texts[i]})
			durs = append(durs, time.Since(start))
		}
	}
	b.StopTimer()
	slices.Sort(durs)
	p99 := durs[len(durs)*99/100]
	// The index's share of a pick, for the record: its match alone.
	var found kvcache.Matches
	var m kvcache.Matcher
	match := make([]time.Duration, 0, picks)
	for i := range picks {
		start := time.Now()
		m.Reset(prompts[i])
		index.MatchAll(&m, &found)
		match = append(match, time.Since(start))
	}
	slices.Sort(match)
	fixed := fixedWork(durs[len(durs)/2], picks)
	b.Logf("%d engines, %d pairs: pick p50 %v p99 %v; the match alone p50 %v p99 %v; a fixed computation as long as the pick's p50: p99 %v; ingest %.0f block events/s building the index from empty, %.0f/s full",
		engines, pairs, durs[len(durs)/2], p99, match[len(match)/2], match[len(match)*99/100], fixed, build.perSecond(), steady.perSecond())

	b.ReportMetric(float64(p99.Nanoseconds())/1e3, "pick-p99-us")
	b.ReportMetric(float64(fixed.Nanoseconds())/1e3, "fixed-p99-us")
	b.ReportMetric(steady.perSecond(), "ingest-events/s")
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(pairs), "bytes/pair")
	runtime.KeepAlive(f)
}

// tokensText is a prompt's text as a client would have sent it: about 4 bytes a token.
func tokensText(tokens []uint32) string {
	out := make([]byte, 0, 4*len(tokens))
	for _, t := range tokens {
		out = append(out, byte('a'+t%26), byte('a'+t/26%26), byte('a'+t/676%26), ' ')
	}
	return string(out)
}

// ingestRate is block events applied and the time that took.
type ingestRate struct {
	events int
	took   time.Duration
}

func (r ingestRate) perSecond() float64 { return float64(r.events) / r.took.Seconds() }

// scaleSteadyRounds is how many prompts each engine stores after its cache is full, each
// in place of its oldest.
const scaleSteadyRounds = 4

// ingestScale has every engine publish its prompts, one message per prompt and engine in
// turn, and applies them as the listener does: decoded from their frames by one Decoder,
// each event applied, the engine touched. Two phases, timed apart (making and encoding
// the messages is not timed): build, each engine storing its prompts into an empty index
// (256 blocks stored for 16 removed a message); then steady, each engine with a full cache
// storing scaleSteadyRounds prompts more, each message evicting its oldest prompt's blocks
// as it stores as many (the prompt stored again, under new hashes and with a new suffix),
// as a busy engine does for as long as it runs.
func ingestScale(b *testing.B, f *scaleFleet, bs []*Backend, index *kvcache.Index) (build, steady ingestRate) {
	type engineState struct {
		next uint64   // the engine's next block hash (its own numbering)
		seq  uint64   // its publisher's sequence
		tail []uint64 // the hashes of its previous prompt's evicted end
	}
	st := make([]engineState, len(bs))
	for e := range st {
		st[e].next = uint64(e+1) << 40
	}
	topic := []byte("kv@10.0.0.1:8000@model")
	var tokens []uint32
	var hashes, evict []uint64
	frames := make([][][]byte, 0, len(bs))
	owner := make([]int, 0, len(bs))
	var dec kvcache.Decoder
	now := time.Now()
	for round := 0; ; round++ {
		frames, owner = frames[:0], owner[:0]
		// One round's payloads, in one allocation: a block takes its hash (9 bytes) and 16
		// token ids (3 or 5 bytes each), an evicted one 9 bytes.
		buf := make([]byte, 0, len(bs)*scalePrompt*(2*9+scaleBlock*5))
		for e := range bs {
			held := len(f.held[e])
			if round >= held+scaleSteadyRounds {
				continue
			}
			// The prompt stored: the next one the engine holds; when steady, the oldest one
			// it holds, which is evicted first (all but its end, evicted the round after
			// it was stored).
			k := round % held
			d := int(f.held[e][k])
			s := &st[e]
			evict = evict[:0]
			if round >= held {
				first := uint64(e+1)<<40 + uint64(round-held)*scalePrompt
				for h := first; h < first+scalePrompt-scaleEvict; h++ {
					evict = append(evict, h)
				}
			}
			tokens = prefixTokens(d, f.prefixLen[d]*scaleBlock, tokens[:0])
			tokens = suffixTokens(uint64(e)<<32|uint64(round), (scalePrompt-f.prefixLen[d])*scaleBlock, tokens)
			hashes = hashes[:0]
			for range scalePrompt {
				hashes = append(hashes, s.next)
				s.next++
			}
			start := len(buf)
			n := 2
			if len(s.tail) > 0 {
				n++
			}
			if len(evict) > 0 {
				n++
			}
			buf = appendArrayHead(buf, 3)
			buf = appendFloat(buf, float64(now.Unix()))
			buf = appendArrayHead(buf, n)
			if len(evict) > 0 {
				buf = appendRemoved(buf, evict)
			}
			pl := f.prefixLen[d]
			buf = appendStored(buf, hashes[:pl], 0, false, tokens[:pl*scaleBlock])
			buf = appendStored(buf, hashes[pl:], hashes[pl-1], true, tokens[pl*scaleBlock:])
			if len(s.tail) > 0 {
				buf = appendRemoved(buf, s.tail)
			}
			buf = appendUint(buf, 0) // data parallel rank
			s.tail = append(s.tail[:0], hashes[scalePrompt-scaleEvict:]...)
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], s.seq)
			s.seq++
			frames = append(frames, [][]byte{topic, seq[:], buf[start:len(buf):len(buf)]})
			owner = append(owner, e)
		}
		if len(frames) == 0 {
			return build, steady
		}
		// buf may have moved as it grew: point every payload into its final place.
		off := 0
		for _, fr := range frames {
			n := len(fr[2])
			fr[2] = buf[off : off+n : off+n]
			off += n
		}
		applied := 0
		start := time.Now()
		for i, fr := range frames {
			m, err := dec.DecodeMessage(fr)
			if err != nil {
				b.Fatal(err)
			}
			name := bs[owner[i]].Name
			for j := range m.Batch.Events {
				ev := &m.Batch.Events[j]
				applied += len(ev.Hashes)
				if why := index.Apply(name, ev); why != "" {
					b.Fatalf("engine %s: event refused: %s", name, why)
				}
			}
			index.Touch(name, start)
		}
		took := time.Since(start)
		// A round is steady once every engine's cache is full: each engine's first prompt
		// stored again.
		phase := &build
		if round >= f.minHeld() {
			phase = &steady
		}
		phase.events += applied
		phase.took += took
	}
}

// The msgpack encoding of vLLM's event batches (array form: msgspec's array_like), written
// out directly so that making a hundred million blocks' messages takes seconds.

func appendArrayHead(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n < 1<<16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v < 1<<8:
		return append(b, 0xcc, byte(v))
	case v < 1<<16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v < 1<<32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func appendStr(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }

func appendFloat(b []byte, v float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(v))
}

// appendStored appends ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
// lora_name].
func appendStored(b []byte, hashes []uint64, parent uint64, hasParent bool, tokens []uint32) []byte {
	b = appendArrayHead(b, 8)
	b = appendStr(b, "BlockStored")
	b = appendArrayHead(b, len(hashes))
	for _, h := range hashes {
		b = appendUint(b, h)
	}
	if hasParent {
		b = appendUint(b, parent)
	} else {
		b = append(b, 0xc0)
	}
	b = appendArrayHead(b, len(tokens))
	for _, t := range tokens {
		b = appendUint(b, uint64(t))
	}
	b = appendUint(b, scaleBlock)
	b = append(b, 0xc0)
	b = appendStr(b, "GPU")
	return append(b, 0xc0)
}

// appendRemoved appends ["BlockRemoved", hashes, medium].
func appendRemoved(b []byte, hashes []uint64) []byte {
	b = appendArrayHead(b, 3)
	b = appendStr(b, "BlockRemoved")
	b = appendArrayHead(b, len(hashes))
	for _, h := range hashes {
		b = appendUint(b, h)
	}
	return appendStr(b, "GPU")
}
