package kvcache

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"go.uber.org/goleak"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	projtestutil "github.com/pdproxy/pdproxy/internal/testutil"
)

const waitTimeout = 10 * time.Second

// waitFor polls cond until it holds, failing the test with its last reason after waitTimeout.
func waitFor(t *testing.T, cond func() (bool, string)) {
	t.Helper()
	projtestutil.WaitFor(t, waitTimeout, cond)
}

// pubEngine is an engine's KV event publisher as vLLM runs it: a PUB socket sending
// [topic, sequence, payload], and a ROUTER answering replays from what it sent.
type pubEngine struct {
	t     *testing.T
	pub   zmq4.Socket
	topic string

	mu   sync.Mutex
	seq  uint64
	sent map[uint64][]byte
	// replayTopic, when set, goes before each replay answer's sequence, as some publishers
	// answer: [empty, topic, sequence, payload].
	replayTopic []byte
}

// newPubEngine binds a PUB on a free loopback port (the engine's default, "tcp://*:5557"),
// or, with dial set, dials it (an engine pointed at the proxy's kv_events.listen).
func newPubEngine(t *testing.T, dial, topic string) *pubEngine {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &pubEngine{t: t, pub: zmq4.NewPub(ctx), topic: topic, sent: make(map[uint64][]byte)}
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

// newPubEngineAt binds a PUB at endpoint, as an engine restarted with the same config does.
func newPubEngineAt(t *testing.T, endpoint string) *pubEngine {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &pubEngine{t: t, pub: zmq4.NewPub(ctx), sent: make(map[uint64][]byte)}
	if err := p.pub.Listen(endpoint); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { p.pub.Close(); cancel() })
	return p
}

func (p *pubEngine) endpoint() string { return "tcp://" + p.pub.Addr().String() }

// publish sends the payload under the next sequence.
func (p *pubEngine) publish(payload []byte) uint64 {
	p.mu.Lock()
	seq := p.seq
	p.seq++
	p.mu.Unlock()
	p.send(seq, payload)
	return seq
}

// lose records the payload under the next sequence for replay, without sending it: the
// subscriber missed it.
func (p *pubEngine) lose(payload []byte) {
	p.mu.Lock()
	p.sent[p.seq] = payload
	p.seq++
	p.mu.Unlock()
}

func (p *pubEngine) send(seq uint64, payload []byte) {
	p.t.Helper()
	p.mu.Lock()
	p.sent[seq] = payload
	p.mu.Unlock()
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), seqBytes(seq), payload)); err != nil {
		p.t.Fatal(err)
	}
}

// sendRaw sends frames as they are.
func (p *pubEngine) sendRaw(frames ...[]byte) {
	p.t.Helper()
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		p.t.Fatal(err)
	}
}

// serveReplay answers replay requests on a ROUTER, as vLLM's publisher does, until the test
// ends; it returns the endpoint.
func (p *pubEngine) serveReplay() string {
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
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue
			}
			if len(msg.Frames) != 3 {
				continue
			}
			id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
			p.mu.Lock()
			end := p.seq
			var replies [][][]byte
			answer := func(seq uint64, pl []byte) [][]byte {
				if p.replayTopic != nil {
					return [][]byte{id, {}, p.replayTopic, seqBytes(seq), pl}
				}
				return [][]byte{id, {}, seqBytes(seq), pl}
			}
			for s := start; s < end; s++ {
				if pl, ok := p.sent[s]; ok {
					replies = append(replies, answer(s, pl))
				}
			}
			p.mu.Unlock()
			replies = append(replies, answer(endSeq, []byte{}))
			for _, f := range replies {
				_ = r.SendMulti(zmq4.NewMsgFrom(f...))
			}
		}
	}()
	t.Cleanup(func() { cancel(); r.Close(); <-done })
	return "tcp://" + r.Addr().String()
}

// harness runs Events until the test ends.
type harness struct {
	t     *testing.T
	ev    *Events
	index *Index
	reg   *prometheus.Registry
	// logs are what Events logged, at every level.
	logs   *observer.ObservedLogs
	cancel context.CancelFunc
	done   chan struct{}
}

func startEvents(t *testing.T, cfg EventsConfig, eps ...Endpoint) *harness {
	t.Helper()
	reg := prometheus.NewRegistry()
	idx := NewIndex(0, 0)
	cfg.Redial = 20 * time.Millisecond
	core, logs := observer.New(zapcore.DebugLevel)
	ev, err := NewEvents(cfg, idx, zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core)), reg)
	if err != nil {
		t.Fatal(err)
	}
	ev.SetEndpoints(eps)
	ctx, cancel := context.WithCancel(context.Background())
	h := &harness{t: t, ev: ev, index: idx, reg: reg, logs: logs, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		if err := ev.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(h.stop)
	return h
}

// listenAddr waits for the listening socket and returns its endpoint.
func (h *harness) listenAddr() string {
	h.t.Helper()
	select {
	case <-h.ev.Bound():
	case <-time.After(waitTimeout):
		h.t.Fatal("the listening socket never bound")
	}
	return "tcp://" + h.ev.Addr().String()
}

func (h *harness) stop() {
	h.cancel()
	select {
	case <-h.done:
	case <-time.After(waitTimeout):
		h.t.Fatal("Events.Run did not return after its context was canceled")
	}
}

// connect publishes empty batches until the engine's subscriber has one: a PUB drops what
// it sends before the SUB's subscription reaches it.
func (h *harness) connect(p *pubEngine, engine string) {
	h.t.Helper()
	waitFor(h.t, func() (bool, string) {
		if s, ok := h.index.Stats(engine); ok && !s.Last.IsZero() {
			return true, ""
		}
		p.publish(payload(h.t))
		return false, fmt.Sprintf("no message of %s reached the index", engine)
	})
}

func (h *harness) matched(engine string, tokens []uint32) int {
	return h.index.Match(NewMatcher(tokens), engine).Matched
}

// waitMatched waits until engine matches want tokens of the prompt.
func (h *harness) waitMatched(engine string, tokens []uint32, want int) {
	h.t.Helper()
	waitFor(h.t, func() (bool, string) {
		got := h.matched(engine, tokens)
		return got == want, fmt.Sprintf("engine %s matches %d tokens, want %d", engine, got, want)
	})
}

func (h *harness) counter(name string, labels ...string) float64 {
	var c prometheus.Collector
	switch name {
	case "dropped":
		c = h.ev.metrics.dropped.WithLabelValues(labels...)
	case "resets":
		c = h.ev.metrics.resets.WithLabelValues(labels...)
	case "events":
		c = h.ev.metrics.events.WithLabelValues(labels...)
	case "replays":
		c = h.ev.metrics.replays.WithLabelValues(labels...)
	}
	return testutil.ToFloat64(c)
}

func (h *harness) waitCounter(want float64, name string, labels ...string) {
	h.t.Helper()
	waitFor(h.t, func() (bool, string) {
		got := h.counter(name, labels...)
		return got == want, fmt.Sprintf("%s%v = %v, want %v", name, labels, got, want)
	})
}

const bs = 4

func TestEventsDialedEngine(t *testing.T) {
	prompt := tokensN(0, 16)
	hashes := engineHashes(1, 4)

	t.Run("stored blocks become a match and a BlockRemoved takes it back", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		p.publish(payload(t, removed(hashes[2:]...)))
		h.waitMatched("a", prompt, 8)
		if got := h.counter("events", "a", "block_removed"); got != 1 {
			t.Errorf("block_removed events counted %v, want 1", got)
		}
		if n := testutil.CollectAndCount(h.reg, "pdproxy_kv_index_blocks"); n != 1 {
			t.Errorf("pdproxy_kv_index_blocks has %d series, want 1", n)
		}
	})

	t.Run("a restarted engine, its sequence back at 0, is forgotten", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		p.send(0, payload(t))
		h.waitMatched("a", prompt, 0)
		h.waitCounter(1, "resets", "a", "sequence_reset")
	})

	t.Run("an engine restarted on the same port is dialed again and its old blocks forgotten", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		ep := p.endpoint()
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: ep})
		h.connect(p, "a")
		// A long-running engine: its sequence is far above where a restarted one starts,
		// so the restart cannot pass for the next message (the jump here is a gap, which
		// forgets what came before and applies the batch).
		p.mu.Lock()
		p.seq = 1000
		p.mu.Unlock()
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		p.pub.Close()
		restarted := newPubEngineAt(t, ep)
		// Its sequence starts at 0 again, below the last one seen, once the SUB is back.
		waitFor(t, func() (bool, string) {
			restarted.publish(payload(t))
			got := h.matched("a", prompt)
			return got == 0, fmt.Sprintf("engine matches %d tokens after its restart, want 0", got)
		})
		restarted.publish(payload(t, stored(hashes[:1], nil, prompt[:4], bs)))
		h.waitMatched("a", prompt, 4)
	})

	t.Run("AllBlocksCleared forgets the engine", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		p.publish(payload(t, cleared()))
		h.waitMatched("a", prompt, 0)
		h.waitCounter(1, "resets", "a", "cleared")
	})

	t.Run("a gap is filled by a replay", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint(), Replay: p.serveReplay()})
		h.connect(p, "a")
		before := h.counter("replays", "a", "ok") // catching up on what connecting missed
		p.publish(payload(t, stored(hashes[:1], nil, prompt[:4], bs)))
		p.lose(payload(t, stored(hashes[1:2], hashes[0], prompt[4:8], bs)))
		p.lose(payload(t, stored(hashes[2:3], hashes[1], prompt[8:12], bs)))
		p.publish(payload(t, stored(hashes[3:], hashes[2], prompt[12:], bs)))
		h.waitMatched("a", prompt, 16)
		h.waitCounter(before+1, "replays", "a", "ok")
	})

	t.Run("a replay whose answers carry the topic fills the gap too", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		p.replayTopic = []byte("kv@127.0.0.1@m")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint(), Replay: p.serveReplay()})
		h.connect(p, "a")
		before := h.counter("replays", "a", "ok")
		p.publish(payload(t, stored(hashes[:1], nil, prompt[:4], bs)))
		p.lose(payload(t, stored(hashes[1:3], hashes[0], prompt[4:12], bs)))
		p.publish(payload(t, stored(hashes[3:], hashes[2], prompt[12:], bs)))
		h.waitMatched("a", prompt, 16)
		h.waitCounter(before+1, "replays", "a", "ok")
	})

	t.Run("a subscriber joining late catches up by replay on the blocks stored before", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		p.lose(payload(t, stored(hashes[:2], nil, prompt[:8], bs)))
		p.lose(payload(t, stored(hashes[2:], hashes[1], prompt[8:], bs)))
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint(), Replay: p.serveReplay()})
		h.connect(p, "a")
		h.waitMatched("a", prompt, 16)
	})

	t.Run("a gap without a replay endpoint forgets the engine", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes[:2], nil, prompt[:8], bs)))
		h.waitMatched("a", prompt, 8)
		p.lose(payload(t, stored(hashes[2:3], hashes[1], prompt[8:12], bs)))
		p.publish(payload(t, stored(hashes[3:], hashes[2], prompt[12:], bs)))
		h.waitCounter(1, "resets", "a", "gap")
		h.waitCounter(1, "dropped", "a", ReasonUnknownParent)
		if got := h.matched("a", prompt); got != 0 {
			t.Errorf("after an unfilled gap the engine matches %d tokens, want 0", got)
		}
	})

	t.Run("a replay endpoint that does not answer forgets the engine and subscribing goes on", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{ReplayTimeout: 100 * time.Millisecond},
			Endpoint{Engine: "a", Dial: p.endpoint(), Replay: "tcp://127.0.0.1:1"})
		h.connect(p, "a")
		before := h.counter("replays", "a", "failed") // catching up on what connecting missed
		p.publish(payload(t, stored(hashes[:2], nil, prompt[:8], bs)))
		h.waitMatched("a", prompt, 8)
		p.lose(payload(t))
		p.publish(payload(t))
		h.waitCounter(before+1, "replays", "a", "failed")
		h.waitMatched("a", prompt, 0)
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
	})

	t.Run("malformed messages are dropped and counted and the next good one applies", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.sendRaw([]byte("t"), seqBytes(100))
		p.sendRaw([]byte("t"), []byte{1}, payload(t))
		p.publish([]byte{0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff})
		p.publish(payload(t, []any{"BlockTeleported", 1}, stored(hashes, nil, prompt[:5], bs)))
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		for reason, want := range map[string]float64{ReasonFrames: 2, ReasonDecode: 1, "unknown_tag": 1, "malformed": 1} {
			if got := h.counter("dropped", "a", reason); got != want {
				t.Errorf("dropped{reason=%q} = %v, want %v", reason, got, want)
			}
		}
	})

	t.Run("with the publisher gone the index keeps what it knew and stops cleanly", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		p.pub.Close()
		// The subscriber has seen the connection end once it tries, and fails, to dial again.
		waitFor(t, func() (bool, string) {
			return h.logs.FilterMessageSnippet("dial failed").Len() > 0, "the subscriber never dialed the gone publisher again"
		})
		if got := h.matched("a", prompt); got != 16 {
			t.Errorf("after the publisher went the engine matches %d, want 16", got)
		}
		h.stop()
	})

	t.Run("a removed backend leaves the index and its subscriber stops", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		h.ev.SetEndpoints(nil)
		h.waitMatched("a", prompt, 0)
		if _, ok := h.index.Stats("a"); ok {
			t.Error("the removed engine is still in the index")
		}
	})
}

func TestEventsListening(t *testing.T) {
	prompt := tokensN(0, 16)
	h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"},
		Endpoint{Engine: "a", HostPort: "10.0.0.1:8000"}, Endpoint{Engine: "b", HostPort: "10.0.0.2:8000"})
	// The engines publish from loopback, as engines behind a NAT would from its address.
	h.ev.SetAllowedSources([]netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")})
	listen := h.listenAddr()
	a := newPubEngine(t, listen, "kv@10.0.0.1:8000@model")
	b := newPubEngine(t, listen, "kv@10.0.0.2:8000@model")
	stranger := newPubEngine(t, listen, "kv@10.9.9.9:8000@model")
	h.connect(a, "a")
	h.connect(b, "b")

	t.Run("each topic's blocks go to its backend", func(t *testing.T) {
		a.publish(payload(t, stored(engineHashes(1, 4), nil, prompt, bs)))
		b.publish(payload(t, stored(engineHashes(2, 2), nil, prompt[:8], bs)))
		h.waitMatched("a", prompt, 16)
		h.waitMatched("b", prompt, 8)
	})
	t.Run("an engine serving in both roles feeds both its backends", func(t *testing.T) {
		h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"},
			Endpoint{Engine: "prefill-127.0.0.1:8000", HostPort: "127.0.0.1:8000"}, Endpoint{Engine: "decode-127.0.0.1:8000", HostPort: "127.0.0.1:8000"})
		p := newPubEngine(t, h.listenAddr(), "kv@127.0.0.1:8000@model")
		h.connect(p, "decode-127.0.0.1:8000")
		p.publish(payload(t, stored(engineHashes(1, 4), nil, prompt, bs)))
		h.waitMatched("prefill-127.0.0.1:8000", prompt, 16)
		h.waitMatched("decode-127.0.0.1:8000", prompt, 16)
	})
	t.Run("a topic naming no backend is dropped and counted", func(t *testing.T) {
		waitFor(t, func() (bool, string) {
			stranger.publish(payload(t, stored(engineHashes(3, 4), nil, prompt, bs)))
			n := h.counter("dropped", unknownBackend, "unknown_topic")
			return n > 0, "no unknown_topic drop counted"
		})
		if got := len(h.index.Engines()); got != 2 {
			t.Errorf("index holds %d engines, want the 2 backends", got)
		}
	})
}

func TestEventsListeningSurvivesAPeerAnnouncingAHugeFrame(t *testing.T) {
	h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"}, Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
	h.listenAddr()
	for _, header := range [][]byte{
		{0x06, 0, 0, 1, 0, 0, 0, 0, 0}, // a command frame of 2^40 bytes: the handshake
		{0x06, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
	} {
		c, err := net.Dial("tcp", h.ev.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		// ZMTP 3.0's greeting with the NULL mechanism, then the hostile frame header.
		greeting := make([]byte, 64)
		greeting[0], greeting[9], greeting[10], greeting[11] = 0xff, 0x7f, 3, 0
		copy(greeting[12:], "NULL")
		if _, err := c.Write(append(greeting, header...)); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(waitTimeout))
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Errorf("the proxy did not close the connection of a peer announcing a huge frame: %v", err)
		}
		c.Close()
	}
	p := newPubEngine(t, "tcp://"+h.ev.Addr().String(), "kv@127.0.0.1:8000@m")
	h.connect(p, "a")
	p.publish(payload(t, stored(engineHashes(1, 1), nil, tokensN(0, bs), bs)))
	h.waitMatched("a", tokensN(0, bs), bs)
}

func TestBoundedConnFollowsFraming(t *testing.T) {
	frame := func(flags byte, body []byte) []byte {
		if len(body) > 255 {
			var b [8]byte
			binary.BigEndian.PutUint64(b[:], uint64(len(body)))
			return append(append([]byte{flags | flagLong}, b[:]...), body...)
		}
		return append([]byte{flags, byte(len(body))}, body...)
	}
	stream := append(make([]byte, zmtpGreeting), frame(0x04, []byte("\x05READY"))...)
	stream = append(stream, frame(0x01, []byte("topic"))...)
	stream = append(stream, frame(0x00, make([]byte, 1000))...)
	var messages, tooManyFrames []byte
	for range 2 * maxMessageFrames {
		messages = append(messages, frame(flagMore, []byte("topic"))...)
		messages = append(messages, frame(0x00, []byte("payload"))...)
		tooManyFrames = append(tooManyFrames, frame(flagMore, nil)...)
	}
	// Two frame headers of more than half the bound each, the first's body passed.
	half := binary.BigEndian.AppendUint64([]byte{flagMore | flagLong}, maxMessage/2+1)
	tooManyBytes := append(append(half, make([]byte, maxMessage/2+1)...), half...)
	tests := []struct {
		name    string
		stream  []byte
		chunk   int
		wantErr bool
	}{
		{name: "frames within the bound pass, read whole", stream: stream, chunk: len(stream)},
		{name: "frames within the bound pass, read a byte at a time", stream: stream, chunk: 1},
		{name: "a long frame over the bound is refused", stream: append(append([]byte(nil), stream...), 0x02, 0, 0, 0, 0, 0x10, 0, 0, 0), chunk: 7, wantErr: true},
		{name: "messages of a few frames each pass, however many", stream: append(append([]byte(nil), stream...), messages...), chunk: 5},
		{name: "a message of too many frames is refused", stream: append(append([]byte(nil), stream...), tooManyFrames...), chunk: 3, wantErr: true},
		{name: "a message of too many bytes in frames under the bound is refused", stream: append(append([]byte(nil), stream...), tooManyBytes...), chunk: 9, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := &boundedConn{greeting: zmtpGreeting}
			var err error
			for b := tt.stream; len(b) > 0 && err == nil; {
				k := min(tt.chunk, len(b))
				err = c.follow(b[:k])
				b = b[k:]
			}
			if (err != nil) != tt.wantErr {
				t.Errorf("follow error = %v, want error %v", err, tt.wantErr)
			}
		})
	}
}

// zmtpPeer is a ZMTP 3 publisher written by hand, dialing from a chosen loopback address:
// what a hostile peer sends, which zmq4's own sockets would not.
type zmtpPeer struct {
	t *testing.T
	c net.Conn
}

// dialZMTP connects to addr from the address from ("": the system's choice), saying nothing.
func dialZMTP(t *testing.T, addr, from string) *zmtpPeer {
	t.Helper()
	d := net.Dialer{Timeout: waitTimeout}
	if from != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &zmtpPeer{t: t, c: c}
}

// zmtpFrame is one ZMTP 3 frame of flags and body.
func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], uint64(len(body)))
		return append(append([]byte{flags | flagLong}, b[:]...), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// handshake greets with the NULL mechanism and says READY as a PUB; it reports whether the
// other side answered with its own greeting and READY.
func (p *zmtpPeer) handshake() bool {
	p.t.Helper()
	greeting := make([]byte, zmtpGreeting)
	greeting[0], greeting[9], greeting[10], greeting[11] = 0xff, 0x7f, 3, 0
	copy(greeting[12:], "NULL")
	ready := append([]byte("\x05READY\x0bSocket-Type"), 0, 0, 0, 3)
	ready = append(ready, "PUB"...)
	if _, err := p.c.Write(append(greeting, zmtpFrame(0x04, ready)...)); err != nil {
		return false
	}
	_ = p.c.SetReadDeadline(time.Now().Add(waitTimeout))
	defer p.c.SetReadDeadline(time.Time{})
	var hdr [2]byte
	if _, err := io.ReadFull(p.c, make([]byte, zmtpGreeting)); err != nil {
		return false
	}
	if _, err := io.ReadFull(p.c, hdr[:]); err != nil || hdr[0] != 0x04 {
		return false
	}
	_, err := io.ReadFull(p.c, make([]byte, hdr[1]))
	return err == nil
}

// send writes frames as one message.
func (p *zmtpPeer) send(frames ...[]byte) error {
	var b []byte
	for i, f := range frames {
		flags := byte(0)
		if i < len(frames)-1 {
			flags = flagMore
		}
		b = append(b, zmtpFrame(flags, f)...)
	}
	_, err := p.c.Write(b)
	return err
}

// closed reports whether the other side closes the connection within waitTimeout.
func (p *zmtpPeer) closed() bool {
	_ = p.c.SetReadDeadline(time.Now().Add(waitTimeout))
	_, err := io.Copy(io.Discard, p.c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

func TestEventsDropAConnectionCarryingAnOversizedMessage(t *testing.T) {
	manyFrames := make([][]byte, maxMessageFrames+1)
	for i := range manyFrames {
		manyFrames[i] = []byte{}
	}
	big := make([]byte, maxMessage/2+1)
	for _, tt := range []struct {
		name   string
		frames [][]byte
	}{
		{"a message of more frames than any KV event has", manyFrames},
		{"a message of more bytes than any KV event has, in frames each under the bound", [][]byte{[]byte("kv@127.0.0.1:8000@m"), big, big}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"}, Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
			h.listenAddr()
			p := dialZMTP(t, h.ev.Addr().String(), "")
			if !p.handshake() {
				t.Fatal("the listening socket did not complete the handshake")
			}
			_ = p.send(tt.frames...) // the proxy may close before it has read all
			if !p.closed() {
				t.Fatal("the proxy kept the connection of a peer sending an oversized message")
			}
			h.waitCounter(1, "dropped", unknownBackend, reasonTooLarge)
			// Others are heard still.
			pub := newPubEngine(t, "tcp://"+h.ev.Addr().String(), "kv@127.0.0.1:8000@m")
			h.connect(pub, "a")
		})
	}

	t.Run("a dialed engine's connection is dropped, counted under the backend and dialed again", func(t *testing.T) {
		p := newPubEngine(t, "", "")
		h := startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
		h.connect(p, "a")
		p.sendRaw(manyFrames...)
		h.waitCounter(1, "dropped", "a", reasonTooLarge)
		prompt := tokensN(0, 8)
		waitFor(t, func() (bool, string) {
			p.publish(payload(t, stored(engineHashes(1, 2), nil, prompt, bs)))
			got := h.matched("a", prompt)
			return got == 8, fmt.Sprintf("after the redial the engine matches %d tokens, want 8", got)
		})
	})
}

func TestEventsListeningHandshakes(t *testing.T) {
	t.Run("a peer that says nothing holds up no engine's events", func(t *testing.T) {
		// A deadline far past the test's wait: only handshakes apart from each other pass.
		h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0", HandshakeTimeout: time.Hour},
			Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
		listen := h.listenAddr()
		dialZMTP(t, h.ev.Addr().String(), "")
		p := newPubEngine(t, listen, "kv@127.0.0.1:8000@m")
		h.connect(p, "a")
		p.publish(payload(t, stored(engineHashes(1, 1), nil, tokensN(0, bs), bs)))
		h.waitMatched("a", tokensN(0, bs), bs)
	})
	t.Run("a peer that says nothing is closed at the handshake's deadline", func(t *testing.T) {
		h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0", HandshakeTimeout: 100 * time.Millisecond},
			Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
		h.listenAddr()
		if p := dialZMTP(t, h.ev.Addr().String(), ""); !p.closed() {
			t.Error("the connection of a peer that never greeted is still open")
		}
	})
}

func TestEventsListeningTrustsTheBackendsAddresses(t *testing.T) {
	prompt := tokensN(0, 16)
	hashes := engineHashes(1, 4)
	// a's engine publishes from 127.0.0.1, b's from 127.0.0.2; 127.0.0.3 is no backend's.
	start := func(t *testing.T) (*harness, *pubEngine) {
		h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"},
			Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"}, Endpoint{Engine: "b", HostPort: "127.0.0.2:8000"})
		a := newPubEngine(t, h.listenAddr(), "kv@127.0.0.1:8000@m")
		h.connect(a, "a")
		a.publish(payload(t, stored(hashes, nil, prompt, bs)))
		h.waitMatched("a", prompt, 16)
		return h, a
	}

	t.Run("a message naming a backend at another address is dropped and counted under it", func(t *testing.T) {
		h, _ := start(t)
		forger := dialZMTP(t, h.ev.Addr().String(), "127.0.0.2") // b's address, speaking for a
		if !forger.handshake() {
			t.Fatal("the listening socket did not complete a backend's handshake")
		}
		// A far sequence would forget a's blocks; a BlockStored would steer its routing.
		if err := forger.send([]byte("kv@127.0.0.1:8000@m"), seqBytes(1<<40), payload(t, cleared())); err != nil {
			t.Fatal(err)
		}
		other := tokensN(100, 8)
		if err := forger.send([]byte("kv@127.0.0.1:8000@m"), seqBytes(1<<40+1), payload(t, stored(engineHashes(9, 2), nil, other, bs))); err != nil {
			t.Fatal(err)
		}
		h.waitCounter(2, "dropped", "a", reasonUnknownSource)
		if got := h.matched("a", prompt); got != 16 {
			t.Errorf("after the forged messages a matches %d tokens, want 16", got)
		}
		if got := h.matched("a", other); got != 0 {
			t.Errorf("a matches %d tokens of a forged BlockStored, want 0", got)
		}
		// b's own messages pass.
		if err := forger.send([]byte("kv@127.0.0.2:8000@m"), seqBytes(0), payload(t, stored(hashes[:1], nil, prompt[:4], bs))); err != nil {
			t.Fatal(err)
		}
		h.waitMatched("b", prompt, 4)
	})

	t.Run("a peer at no backend's address is closed before its handshake and counted", func(t *testing.T) {
		h, _ := start(t)
		stranger := dialZMTP(t, h.ev.Addr().String(), "127.0.0.3")
		if !stranger.closed() {
			t.Fatal("the connection of a peer at no backend's address is open")
		}
		h.waitCounter(1, "dropped", unknownBackend, reasonUnknownSource)
	})

	t.Run("an allowed source speaks for any backend", func(t *testing.T) {
		h, _ := start(t)
		h.ev.SetAllowedSources([]netip.Prefix{netip.MustParsePrefix("127.0.0.0/30")})
		relay := dialZMTP(t, h.ev.Addr().String(), "127.0.0.3")
		if !relay.handshake() {
			t.Fatal("the listening socket did not complete an allowed source's handshake")
		}
		if err := relay.send([]byte("kv@127.0.0.2:8000@m"), seqBytes(0), payload(t, stored(hashes[:2], nil, prompt[:8], bs))); err != nil {
			t.Fatal(err)
		}
		h.waitMatched("b", prompt, 8)
	})

	t.Run("a backend named by host name is resolved", func(t *testing.T) {
		h := startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"}, Endpoint{Engine: "a", HostPort: "localhost:8000"})
		a := newPubEngine(t, h.listenAddr(), "kv@localhost:8000@m")
		h.connect(a, "a")
	})
}

func TestEventsListenWithoutAHostBindsLoopback(t *testing.T) {
	h := startEvents(t, EventsConfig{Listen: "tcp://:0"}, Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
	h.listenAddr()
	ap, err := netip.ParseAddrPort(h.ev.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if !ap.Addr().IsLoopback() {
		t.Errorf("tcp://:0 bound %v, want a loopback address", ap)
	}
}

func TestParseSource(t *testing.T) {
	tests := []struct {
		in, want string // want "" means refused
	}{
		{"10.0.0.7", "10.0.0.7/32"},
		{"10.0.0.0/24", "10.0.0.0/24"},
		{"::ffff:10.0.0.7", "10.0.0.7/32"},
		{"fd00::/8", "fd00::/8"},
		{"10.0.0.7/24", ""},
		{"10.0.0.300", ""},
		{"10.0.0.0/33", ""},
		{"fe80::1%eth0", ""},
		{"engine-0", ""},
		{"", ""},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			p, err := ParseSource(tt.in)
			switch {
			case tt.want == "" && err == nil:
				t.Errorf("ParseSource(%q) = %v, want an error", tt.in, p)
			case tt.want != "" && (err != nil || p.String() != tt.want):
				t.Errorf("ParseSource(%q) = %v, %v, want %s", tt.in, p, err, tt.want)
			}
		})
	}
}

func TestEventsLeaveNoReaderBehindAPublisherThatKeepsSending(t *testing.T) {
	// Big batches keep the proxy's handling behind the publisher, so that zmq4 has read
	// ahead all it queues when the events stop.
	const blocks = 512
	var batches [][]byte
	for i := range 32 {
		batches = append(batches, payload(t, stored(engineHashes(uint64(i+1)<<20, blocks), nil, tokensN(i*blocks*bs, blocks*bs), bs)))
	}
	for _, mode := range []string{"dialed", "listening"} {
		t.Run("an engine "+mode, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			// Registered first, run last: after the publisher and the events are gone.
			t.Cleanup(func() {
				goleak.VerifyNone(t, ignore, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
			})
			var h *harness
			var p *pubEngine
			if mode == "dialed" {
				p = newPubEngine(t, "", "")
				h = startEvents(t, EventsConfig{}, Endpoint{Engine: "a", Dial: p.endpoint()})
			} else {
				h = startEvents(t, EventsConfig{Listen: "tcp://127.0.0.1:0"}, Endpoint{Engine: "a", HostPort: "127.0.0.1:8000"})
				p = newPubEngine(t, h.listenAddr(), "kv@127.0.0.1:8000@m")
			}
			h.connect(p, "a")
			stop := make(chan struct{})
			flooding := make(chan struct{})
			go func() {
				defer close(flooding)
				for i := 1; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					// Errors once the proxy has gone are what this test waits for.
					_ = p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), seqBytes(uint64(1000+i)), batches[i%len(batches)]))
				}
			}()
			waitFor(t, func() (bool, string) {
				s, _ := h.index.Stats("a")
				return s.Blocks >= 4*blocks, fmt.Sprintf("the index holds %d of a's blocks", s.Blocks)
			})
			h.stop()
			close(stop)
			<-flooding
		})
	}
}
