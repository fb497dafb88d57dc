package router

import (
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// kvPublisher is an engine's KV event publisher as vLLM runs it: a PUB socket sending
// [topic, 8-byte big-endian sequence, msgpack batch], and optionally the ROUTER that replays.
type kvPublisher struct {
	t     *testing.T
	pub   zmq4.Socket
	topic string

	mu   sync.Mutex
	seq  uint64
	sent map[uint64][]byte
}

// newKVPublisher binds a PUB on a free loopback port, or dials one (the proxy's listen).
func newKVPublisher(t *testing.T, dial, topic string) *kvPublisher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &kvPublisher{t: t, pub: zmq4.NewPub(ctx), topic: topic, sent: make(map[uint64][]byte)}
	var err error
	if dial != "" {
		err = p.pub.Dial(dial)
	} else {
		err = p.pub.Listen("tcp://127.0.0.1:0")
	}
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { p.pub.Close(); cancel() })
	return p
}

func (p *kvPublisher) endpoint() string { return "tcp://" + p.pub.Addr().String() }

func (p *kvPublisher) next(payload []byte, send bool) {
	p.mu.Lock()
	seq := p.seq
	p.seq++
	p.sent[seq] = payload
	p.mu.Unlock()
	if !send {
		return
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), sb[:], payload)); err != nil {
		p.t.Error(err)
	}
}

// publish sends events as the next batch; lose records them for replay only.
func (p *kvPublisher) publish(events ...any) { p.next(batchOf(p.t, events...), true) }
func (p *kvPublisher) lose(events ...any)    { p.next(batchOf(p.t, events...), false) }

func (p *kvPublisher) sendRaw(frames ...[]byte) {
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		p.t.Error(err)
	}
}

// serveReplay answers replays as vLLM's ROUTER does, until the test ends.
func (p *kvPublisher) serveReplay() string {
	t := p.t
	ctx, cancel := context.WithCancel(context.Background())
	r := zmq4.NewRouter(ctx)
	if err := r.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := r.Recv()
			if ctx.Err() != nil {
				return
			}
			if err != nil || len(msg.Frames) != 3 {
				continue
			}
			id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
			p.mu.Lock()
			var out [][][]byte
			for s := start; s < p.seq; s++ {
				var sb [8]byte
				binary.BigEndian.PutUint64(sb[:], s)
				out = append(out, [][]byte{id, {}, sb[:], p.sent[s]})
			}
			p.mu.Unlock()
			out = append(out, [][]byte{id, {}, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, {}})
			for _, f := range out {
				_ = r.SendMulti(zmq4.NewMsgFrom(f...))
			}
		}
	}()
	t.Cleanup(func() { cancel(); r.Close(); <-done })
	return "tcp://" + r.Addr().String()
}

func batchOf(t *testing.T, events ...any) []byte {
	t.Helper()
	if events == nil {
		events = []any{}
	}
	p, err := msgpack.Marshal([]any{1733000000.0, events, 0})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// blockStored is vLLM's BlockStored, array form: the engine's hashes of the blocks of tokens
// (block size kvBlock), after the block hashed parent (nil for a prompt's first).
func blockStored(hashes []uint64, parent any, tokens []uint32) []any {
	return []any{"BlockStored", hashes, parent, tokens, kvBlock, nil, "GPU", nil}
}

func blockRemoved(hashes ...uint64) []any { return []any{"BlockRemoved", hashes, "GPU"} }

const kvBlock = 16

// promptTokens are n token ids from from, and the hashes an engine with seed gives their
// blocks.
func promptTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func hashesOf(seed uint64, blocks int) []uint64 {
	out := make([]uint64, blocks)
	for i := range out {
		out[i] = seed<<32 | uint64(i+1)
	}
	return out
}

// preciseRouter runs a router picking decoders with precise_cache_aware until the test ends.
type preciseRouter struct {
	*Router
	reg *prometheus.Registry
}

func startPrecise(t *testing.T, cfg routerconfig.Config) *preciseRouter {
	t.Helper()
	cfg.DecodePolicy = routerconfig.PolicyPreciseCacheAware
	if cfg.Health.Interval == 0 {
		cfg.Health.Interval = -1
	}
	reg := prometheus.NewRegistry()
	r, err := New(cfg, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := r.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return &preciseRouter{Router: r, reg: reg}
}

func (r *preciseRouter) listenAddr(t *testing.T) string {
	t.Helper()
	testutil.Recv(t, testutil.Timeout, r.events.Bound(), "the kv events listener to bind")
	return "tcp://" + r.events.Addr().String()
}

// connect publishes empty batches until the backend's subscriber has one: a PUB drops what
// it sends before the subscription reaches it.
func (r *preciseRouter) connect(t *testing.T, p *kvPublisher, backend string) {
	t.Helper()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		if s, ok := r.index.Stats(backend); ok && !s.Last.IsZero() {
			return true, ""
		}
		p.publish()
		return false, fmt.Sprintf("no KV event of %s reached the router", backend)
	})
}

func (r *preciseRouter) blocks(backend string) int {
	for _, b := range r.Backends() {
		if b.Name == backend && b.PrefixCache != nil && b.PrefixCache.Blocks != nil {
			return *b.PrefixCache.Blocks
		}
	}
	return 0
}

func (r *preciseRouter) waitBlocks(t *testing.T, backend string, want int) {
	t.Helper()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got := r.blocks(backend)
		return got == want, fmt.Sprintf("/debug/backends shows %d blocks on %s, want %d", got, backend, want)
	})
}

// pick acquires a decoder for tokens with every backend's in-flight count as given, and
// releases everything again.
func (r *preciseRouter) pick(t *testing.T, h Hint, inflight map[string]int) string {
	t.Helper()
	var held []*Lease
	for name, n := range inflight {
		for range n {
			held = append(held, mustAcquire(t, r.Router, routerconfig.RoleDecode, Hint{Exclude: others(r.Router, name)}))
		}
	}
	l := mustAcquire(t, r.Router, routerconfig.RoleDecode, h)
	name := l.Backend().Name
	l.Release(Result{Status: 200})
	for _, l := range held {
		l.Release(Result{Status: 200})
	}
	return name
}

// others names every decoder but name.
func others(r *Router, name string) []string {
	var out []string
	for _, b := range r.backends() {
		if b.Name != name {
			out = append(out, b.Name)
		}
	}
	return out
}

// listenCfg is three decoders whose engines dial the router's kv_events.listen, publishing
// from loopback, as engines behind a NAT would from its address.
func listenCfg() routerconfig.Config {
	return routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "d0", URL: "http://10.0.0.1:8000", Role: routerconfig.RoleDecode},
			{Name: "d1", URL: "http://10.0.0.2:8000", Role: routerconfig.RoleDecode},
			{Name: "d2", URL: "http://10.0.0.3:8000", Role: routerconfig.RoleDecode},
		},
		KVEvents: routerconfig.KVEventsConfig{Listen: "tcp://127.0.0.1:0", AllowedSources: []string{"127.0.0.1"}},
	}
}

func TestPreciseCacheAware(t *testing.T) {
	prompt := promptTokens(0, 64*kvBlock)
	next := append(append([]uint32(nil), prompt...), promptTokens(9000, kvBlock)...)
	hashes := hashesOf(7, 64)
	busy := map[string]int{"d1": 8} // d1 busier than the others by more than a tie, but within balance

	setup := func(t *testing.T) (*preciseRouter, *kvPublisher) {
		r := startPrecise(t, listenCfg())
		listen := r.listenAddr(t)
		pubs := map[string]*kvPublisher{}
		for i, name := range []string{"d0", "d1", "d2"} {
			pubs[name] = newKVPublisher(t, listen, fmt.Sprintf("kv@10.0.0.%d:8000@model", i+1))
			r.connect(t, pubs[name], name)
		}
		pubs["d1"].publish(blockStored(hashes, nil, prompt))
		r.waitBlocks(t, "d1", 64)
		return r, pubs["d1"]
	}

	t.Run("a session's next turn lands on the engine holding its blocks", func(t *testing.T) {
		r, _ := setup(t)
		if got := r.pick(t, Hint{Tokens: next}, busy); got != "d1" {
			t.Errorf("picked %s, want d1, which holds 1,024 of the prompt's 1,040 tokens", got)
		}
		if n := testutil.Value(t, r.reg, "pdproxy_prefix_cache_match_ratio", map[string]string{"role": "decode", "policy": routerconfig.PolicyPreciseCacheAware}); n != 1 {
			t.Errorf("match ratio observations = %v, want 1", n)
		}
	})

	t.Run("an evicted prefix stops attracting requests once its BlockRemoved arrives", func(t *testing.T) {
		r, d1 := setup(t)
		d1.publish(blockRemoved(hashes[1:]...))
		r.waitBlocks(t, "d1", 1)
		if got := r.pick(t, Hint{Tokens: next}, busy); got == "d1" {
			t.Error("picked d1, the busiest, though it holds only the prompt's first block: its load costs more than that saves")
		}
	})

	for _, restart := range []struct {
		name   string
		signal func(p *kvPublisher)
	}{
		{"AllBlocksCleared", func(p *kvPublisher) { p.publish([]any{"AllBlocksCleared"}) }},
		{"its sequence starting again", func(p *kvPublisher) {
			p.mu.Lock()
			p.seq = 0
			p.mu.Unlock()
			p.publish()
		}},
	} {
		t.Run("a restarted engine is forgotten: "+restart.name, func(t *testing.T) {
			r, d1 := setup(t)
			restart.signal(d1)
			r.waitBlocks(t, "d1", 0)
			if got := r.pick(t, Hint{Tokens: next}, busy); got == "d1" {
				t.Error("picked d1, the busiest, though its cache was reset")
			}
		})
	}

	t.Run("malformed events are dropped and counted and routing goes on", func(t *testing.T) {
		r, d1 := setup(t)
		d1.sendRaw([]byte(d1.topic), []byte{1, 2})
		d1.sendRaw([]byte(d1.topic), make([]byte, 8), []byte{0xdd, 0xff, 0xff, 0xff, 0xff})
		d1.publish([]any{"BlockTeleported", 1})
		stranger := newKVPublisher(t, r.listenAddr(t), "kv@10.9.9.9:8000@model")
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
			stranger.publish()
			got := map[string]float64{}
			for _, reason := range []string{"frames", "decode", "unknown_tag"} {
				got[reason] = testutil.Value(t, r.reg, "pdproxy_kv_events_dropped_total", map[string]string{"backend": "d1", "reason": reason})
			}
			got["unknown_topic"] = testutil.Value(t, r.reg, "pdproxy_kv_events_dropped_total", map[string]string{"backend": "unknown", "reason": "unknown_topic"})
			ok := got["frames"] == 1 && got["decode"] == 1 && got["unknown_tag"] == 1 && got["unknown_topic"] > 0
			return ok, fmt.Sprintf("dropped = %v", got)
		})
		if got := r.pick(t, Hint{Tokens: next}, busy); got != "d1" {
			t.Errorf("after the bad messages picked %s, want d1, whose blocks stand", got)
		}
		if n := testutil.Value(t, r.reg, "pdproxy_kv_index_blocks", map[string]string{"backend": "d1"}); n != 64 {
			t.Errorf("pdproxy_kv_index_blocks{backend=d1} = %v, want 64", n)
		}
	})
}

func TestPreciseCacheAwareFallsBackToTheRoutedTextWhenAPublisherGoesSilent(t *testing.T) {
	cfg := listenCfg()
	cfg.KVEvents.StaleAfter = 50 * time.Millisecond
	r := startPrecise(t, cfg)
	listen := r.listenAddr(t)
	d1 := newKVPublisher(t, listen, "kv@10.0.0.2:8000@model")
	r.connect(t, d1, "d1")
	prompt := promptTokens(0, 64*kvBlock)
	d1.publish(blockStored(hashesOf(1, 64), nil, prompt))
	r.waitBlocks(t, "d1", 64)
	text := `[{"role":"system","content":"a long shared system prompt: ` + longSystem + `"},{"role":"user","content":"first"}`
	if got := r.pick(t, Hint{Tokens: prompt, Text: text}, map[string]int{"d1": 8}); got != "d1" {
		t.Fatalf("picked %s, want d1, which holds the prompt's blocks", got)
	}
	d1.pub.Close()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		for _, b := range r.Backends() {
			if b.Name == "d1" && b.PrefixCache != nil && b.PrefixCache.Stale {
				return true, ""
			}
		}
		return false, "d1's events never went stale"
	})
	// Its events no longer count; what was routed to it still does.
	if got := r.pick(t, Hint{Tokens: prompt, Text: text + `,{"role":"user","content":"second"}]`}, map[string]int{"d1": 8}); got != "d1" {
		t.Errorf("with d1's publisher gone picked %s, want d1, which was sent the conversation", got)
	}
	if got := r.pick(t, Hint{Tokens: prompt, Text: "an unrelated prompt"}, map[string]int{"d1": 8}); got == "d1" {
		t.Error("with d1's publisher gone an unrelated prompt still went to d1, the busiest")
	}
}

func TestPreciseCacheAwareDialedEngineWithReplay(t *testing.T) {
	pub := newKVPublisher(t, "", "")
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "d0", URL: "http://10.0.0.1:8000", Role: routerconfig.RoleDecode, KVEventsEndpoint: pub.endpoint(), KVEventsReplayEndpoint: pub.serveReplay()},
		{Name: "d1", URL: "http://10.0.0.2:8000", Role: routerconfig.RoleDecode},
	}}
	r := startPrecise(t, cfg)
	r.connect(t, pub, "d0")
	prompt := promptTokens(0, 64*kvBlock)
	h := hashesOf(3, 64)
	pub.publish(blockStored(h[:1], nil, prompt[:kvBlock]))
	pub.lose(blockStored(h[1:32], h[0], prompt[kvBlock:32*kvBlock]))
	pub.publish(blockStored(h[32:], h[31], prompt[32*kvBlock:]))
	r.waitBlocks(t, "d0", 64)
	if n := testutil.Value(t, r.reg, "pdproxy_kv_events_replays_total", map[string]string{"backend": "d0", "result": "ok"}); n < 1 {
		t.Errorf("replays ok = %v, want at least the gap's", n)
	}
	if got := r.pick(t, Hint{Tokens: prompt}, map[string]int{"d0": 3}); got != "d0" {
		t.Errorf("picked %s, want d0, which holds the whole prompt once the gap was replayed", got)
	}
}

func TestPreciseCacheAwareForgetsAnEngineThatGoesDown(t *testing.T) {
	pub := newKVPublisher(t, "", "")
	cfg := routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "d0", URL: "http://10.0.0.1:8000", Role: routerconfig.RoleDecode, KVEventsEndpoint: pub.endpoint()},
			{Name: "d1", URL: "http://10.0.0.2:8000", Role: routerconfig.RoleDecode},
		},
		Health: routerconfig.HealthConfig{Interval: time.Hour},
	}
	r := startPrecise(t, cfg)
	r.connect(t, pub, "d0")
	pub.publish(blockStored(hashesOf(1, 2), nil, promptTokens(0, 2*kvBlock)))
	r.waitBlocks(t, "d0", 2)
	l := mustAcquire(t, r.Router, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
	l.Release(Result{Err: refusedErr(t)}) // nothing listens at d0: down at once
	if got := r.CachedBlocks("d0", 10); got != nil {
		t.Errorf("the index still holds %d blocks of d0, which went down", len(got))
	}
}

func TestWantsTokensOnlyForPrecise(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{
		Backends:      append(backendsCfg(routerconfig.RoleDecode, "d", 1, 0), backendsCfg(routerconfig.RolePrefill, "p", 1, 0)...),
		PrefillPolicy: routerconfig.PolicyPreciseCacheAware, DecodePolicy: routerconfig.PolicyCacheAware,
		KVEvents: routerconfig.KVEventsConfig{Listen: "tcp://127.0.0.1:0"},
	})
	if !r.WantsTokens(routerconfig.RolePrefill) || r.WantsTokens(routerconfig.RoleDecode) {
		t.Errorf("WantsTokens(prefill) = %v, (decode) = %v; want true, false", r.WantsTokens(routerconfig.RolePrefill), r.WantsTokens(routerconfig.RoleDecode))
	}
}

func TestCachedTokensSaysWhatADecoderHolds(t *testing.T) {
	r := startPrecise(t, listenCfg())
	d0 := newKVPublisher(t, r.listenAddr(t), "kv@10.0.0.1:8000@model")
	r.connect(t, d0, "d0")
	prompt := promptTokens(0, 3*kvBlock+5)
	d0.publish(blockStored(hashesOf(1, 2), nil, prompt[:2*kvBlock]))
	r.waitBlocks(t, "d0", 2)
	if n, ok := r.CachedTokens("d0", Hint{Tokens: prompt}); !ok || n != 2*kvBlock {
		t.Errorf("CachedTokens(d0) = %d, %v; want %d, true", n, ok, 2*kvBlock)
	}
	if n, ok := r.CachedTokens("d1", Hint{Tokens: prompt}); ok {
		t.Errorf("CachedTokens(d1), never heard from, = %d, true; want false", n)
	}
}

func BenchmarkPreciseCacheAwareSelect(b *testing.B) {
	const engines = 8
	index := kvcache.NewIndex(0, kvBlock)
	bs := testBackends(make([]int64, engines)...)
	prompt := promptTokens(0, 4096)
	for i, be := range bs {
		// Each engine holds the first 64 blocks, one of them the whole prompt.
		n := 64
		if i == 0 {
			n = len(prompt) / kvBlock
		}
		index.Apply(be.Name, &kvcache.Event{Kind: kvcache.BlockStored, Hashes: hashesOf(uint64(i), n), Tokens: prompt[:n*kvBlock], BlockSize: kvBlock})
		index.Touch(be.Name, time.Now())
	}
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
	text := strings.Repeat("x", 16<<10)
	b.ReportAllocs()
	for b.Loop() {
		p.Select(bs, Hint{Tokens: prompt, Text: text})
	}
}

func TestPreciseIndexKeepsAtMostMaxBlocksInAll(t *testing.T) {
	// Three blocks in all: d0's two fit, d1's two would pass the bound and are dropped as
	// index_full, until d0's removal makes room.
	cfg := listenCfg()
	cfg.KVEvents.MaxBlocks, cfg.KVEvents.MaxBlocksPerBackend = 3, 3
	r := startPrecise(t, cfg)
	listen := r.listenAddr(t)
	d0 := newKVPublisher(t, listen, "kv@10.0.0.1:8000@model")
	d1 := newKVPublisher(t, listen, "kv@10.0.0.2:8000@model")
	r.connect(t, d0, "d0")
	r.connect(t, d1, "d1")
	prompt := promptTokens(0, 2*kvBlock)
	d0.publish(blockStored(hashesOf(1, 2), nil, prompt))
	r.waitBlocks(t, "d0", 2)
	d1.publish(blockStored(hashesOf(2, 2), nil, prompt))
	full := map[string]string{"backend": "d1", "reason": "index_full"}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		n := testutil.Value(t, r.reg, "pdproxy_kv_events_dropped_total", full)
		return n == 1, fmt.Sprintf("d1's store past kv_events.max_blocks dropped %v times as index_full, want 1", n)
	})
	if n := r.blocks("d1"); n != 0 {
		t.Errorf("d1 holds %d blocks past the bound", n)
	}
	d0.publish(blockRemoved(hashesOf(1, 2)...))
	r.waitBlocks(t, "d0", 0)
	d1.publish(blockStored(hashesOf(2, 2), nil, prompt))
	r.waitBlocks(t, "d1", 2)
}
