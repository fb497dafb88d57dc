package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// The consumer here is written from vLLM's wire format (kv_events.py's
// structs and ZmqEventPublisher), not from the sim's encoder: it decodes
// msgpack generically and accepts both event encodings, arrays tagged
// first and maps with "type", as a consumer of several vLLM versions must.

// wireEvent is one decoded KV event.
type wireEvent struct {
	Type      string
	Hashes    []uint64
	Parent    *uint64
	Tokens    []uint64
	BlockSize int64
	Medium    any
	// LoRAName, LoRAID, Extra (one entry per block: a tuple or nil), Group, Kind and
	// Window are vLLM's fields of a block's keys and its KV cache group.
	LoRAName any
	LoRAID   any
	Extra    []any
	HasExtra bool
	Group    int64
	Kind     any
	Window   any
}

// wireBatch is one decoded message.
type wireBatch struct {
	Seq    int64
	TS     float64
	Events []wireEvent
	Rank   int64
}

// Field names of vLLM's event structs, in declaration order (the order of
// their array_like encoding after the tag).
var eventFields = map[string][]string{
	"BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	"BlockRemoved":     {"block_hashes", "medium", "group_idx"},
	"AllBlocksCleared": {},
}

func decodeWireBatch(seq, payload []byte) (wireBatch, error) {
	var b wireBatch
	if len(seq) != 8 {
		return b, fmt.Errorf("sequence frame of %d bytes, want 8", len(seq))
	}
	b.Seq = int64(binary.BigEndian.Uint64(seq))
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	dec.UseLooseInterfaceDecoding(true) // ints as int64/uint64, floats as float64
	v, err := dec.DecodeInterface()
	if err != nil {
		return b, fmt.Errorf("payload: %w", err)
	}
	arr, ok := v.([]any)
	if !ok || len(arr) < 2 {
		return b, fmt.Errorf("payload %T %v: want an array [ts, events, dp_rank]", v, v)
	}
	if b.TS, ok = arr[0].(float64); !ok {
		return b, fmt.Errorf("timestamp %T, want a float", arr[0])
	}
	evs, ok := arr[1].([]any)
	if !ok {
		return b, fmt.Errorf("events %T, want an array", arr[1])
	}
	if len(arr) > 2 && arr[2] != nil {
		r, ok := asInt(arr[2])
		if !ok {
			return b, fmt.Errorf("data_parallel_rank %T", arr[2])
		}
		b.Rank = r
	}
	for i, raw := range evs {
		fields := map[string]any{}
		switch ev := raw.(type) {
		case []any:
			tag, _ := ev[0].(string)
			names, ok := eventFields[tag]
			if !ok {
				return b, fmt.Errorf("event %d: unknown tag %v", i, ev[0])
			}
			fields["type"] = tag
			for k, name := range names {
				if k+1 < len(ev) {
					fields[name] = ev[k+1]
				}
			}
		case map[string]any:
			fields = ev
		default:
			return b, fmt.Errorf("event %d: %T, want an array or a map", i, raw)
		}
		we, err := toWireEvent(fields)
		if err != nil {
			return b, fmt.Errorf("event %d: %w", i, err)
		}
		b.Events = append(b.Events, we)
	}
	return b, nil
}

func toWireEvent(f map[string]any) (wireEvent, error) {
	var e wireEvent
	e.Type, _ = f["type"].(string)
	if _, ok := eventFields[e.Type]; !ok {
		return e, fmt.Errorf("type %v", f["type"])
	}
	if e.Type == "AllBlocksCleared" {
		return e, nil
	}
	hs, ok := f["block_hashes"].([]any)
	if !ok {
		return e, fmt.Errorf("block_hashes %T", f["block_hashes"])
	}
	for _, h := range hs {
		u, ok := asUint(h)
		if !ok {
			return e, fmt.Errorf("block hash %T %v: want an int", h, h)
		}
		e.Hashes = append(e.Hashes, u)
	}
	e.Medium = f["medium"]
	if g, ok := f["group_idx"]; ok && g != nil {
		if e.Group, ok = asInt(g); !ok {
			return e, fmt.Errorf("group_idx %T", g)
		}
	}
	if e.Type == "BlockRemoved" {
		return e, nil
	}
	e.LoRAName, e.LoRAID, e.Kind, e.Window = f["lora_name"], f["lora_id"], f["kv_cache_spec_kind"], f["kv_cache_spec_sliding_window"]
	if x, ok := f["extra_keys"]; ok && x != nil {
		if e.Extra, ok = x.([]any); !ok || len(e.Extra) != len(e.Hashes) {
			return e, fmt.Errorf("extra_keys %v for %d blocks", x, len(e.Hashes))
		}
		e.HasExtra = true
	}
	if p := f["parent_block_hash"]; p != nil {
		u, ok := asUint(p)
		if !ok {
			return e, fmt.Errorf("parent_block_hash %T", p)
		}
		e.Parent = &u
	}
	ts, ok := f["token_ids"].([]any)
	if !ok {
		return e, fmt.Errorf("token_ids %T", f["token_ids"])
	}
	for _, t := range ts {
		u, ok := asUint(t)
		if !ok {
			return e, fmt.Errorf("token id %T", t)
		}
		e.Tokens = append(e.Tokens, u)
	}
	if e.BlockSize, ok = asInt(f["block_size"]); !ok || e.BlockSize <= 0 {
		return e, fmt.Errorf("block_size %v", f["block_size"])
	}
	// A sliding-window group leaves out the blocks out of its window (vLLM's null blocks),
	// and gives the token ids of them all.
	if full := e.Kind == nil || e.Kind == "full_attention"; full && len(e.Tokens) != len(e.Hashes)*int(e.BlockSize) ||
		!full && (len(e.Tokens)%int(e.BlockSize) != 0 || len(e.Hashes) > len(e.Tokens)/int(e.BlockSize)) {
		return e, fmt.Errorf("%d token ids for %d blocks of %d", len(e.Tokens), len(e.Hashes), e.BlockSize)
	}
	return e, nil
}

func asUint(v any) (uint64, bool) {
	switch x := v.(type) {
	case uint64:
		return x, true
	case int64:
		return uint64(x), x >= 0
	}
	return 0, false
}

func asInt(v any) (int64, bool) {
	switch x := v.(type) {
	case uint64:
		return int64(x), x < 1<<63
	case int64:
		return x, true
	}
	return 0, false
}

// cacheModel is what a consumer knows of the engine's cache from its events.
type cacheModel struct {
	blocks  map[uint64]bool
	removed int
	cleared int
}

func (m *cacheModel) apply(t *testing.T, b wireBatch) {
	t.Helper()
	for _, e := range b.Events {
		switch e.Type {
		case "BlockStored":
			if e.Parent != nil && !m.blocks[*e.Parent] {
				t.Errorf("batch %d: BlockStored with parent %x the consumer does not know", b.Seq, *e.Parent)
			}
			for _, h := range e.Hashes {
				if m.blocks[h] {
					t.Errorf("batch %d: block %x stored twice", b.Seq, h)
				}
				m.blocks[h] = true
			}
		case "BlockRemoved":
			for _, h := range e.Hashes {
				if !m.blocks[h] {
					t.Errorf("batch %d: block %x removed but not stored", b.Seq, h)
				}
				delete(m.blocks, h)
				m.removed++
			}
		case "AllBlocksCleared":
			clear(m.blocks)
			m.cleared++
		}
	}
}

// subscriber is a SUB socket reading one topic, with its messages in a channel.
type subscriber struct {
	sock zmq4.Socket
	msgs chan zmq4.Msg
	done chan struct{}
}

func newSubscriber(t *testing.T, topic string, listen bool, ep string) (*subscriber, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &subscriber{sock: zmq4.NewSub(ctx), msgs: make(chan zmq4.Msg, 1024), done: make(chan struct{})}
	var err error
	if listen {
		err = s.sock.Listen(ep)
		ep = "tcp://" + s.sock.Addr().String()
	} else {
		err = s.sock.Dial(ep)
	}
	if err != nil {
		cancel()
		t.Fatalf("subscriber on %s: %v", ep, err)
	}
	if err := s.sock.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(s.done)
		for {
			m, err := s.sock.Recv()
			if err != nil {
				return
			}
			s.msgs <- m
		}
	}()
	t.Cleanup(func() {
		cancel()
		s.sock.Close()
		<-s.done
	})
	return s, ep
}

// next decodes the next message, checking its frames.
func (s *subscriber) next(t *testing.T, topic string) wireBatch {
	t.Helper()
	return decodeMsg(t, testutil.Recv(t, testutil.Timeout, s.msgs, "a kv event message"), topic)
}

func decodeMsg(t *testing.T, m zmq4.Msg, topic string) wireBatch {
	t.Helper()
	if len(m.Frames) != 3 || string(m.Frames[0]) != topic {
		t.Fatalf("message of %d frames, topic %q: want [%q, seq, payload]", len(m.Frames), m.Frames[0], topic)
	}
	b, err := decodeWireBatch(m.Frames[1], m.Frames[2])
	if err != nil {
		t.Fatalf("decode batch: %v", err)
	}
	return b
}

// replayFrom asks the replay socket for the batches from start on.
// waitPublished waits until every batch ts's engine has queued is in its publisher's replay
// history: a step's events are queued under the engine's lock and sent by the publisher's own
// goroutine, so a request seen ended may have events not sent yet.
func waitPublished(t *testing.T, ts *testServer) {
	t.Helper()
	p := ts.e.kv
	testutil.Eventually(t, testutil.Timeout, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.sent == p.queued
	}, "the publisher to send every queued batch")
}

func replayFrom(t *testing.T, ep string, start int64) []wireBatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial(ep); err != nil {
		t.Fatalf("dial replay %s: %v", ep, err)
	}
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], uint64(start))
	// A REQ client's envelope: an empty delimiter, then the start.
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, seq[:])); err != nil {
		t.Fatal(err)
	}
	var out []wireBatch
	for {
		m, err := d.Recv()
		if err != nil {
			t.Fatalf("replay recv: %v", err)
		}
		if len(m.Frames) != 3 || len(m.Frames[0]) != 0 {
			t.Fatalf("replay answer of %d frames, want [\"\", seq, payload]", len(m.Frames))
		}
		if int64(binary.BigEndian.Uint64(m.Frames[1])) == -1 {
			if len(m.Frames[2]) != 0 {
				t.Errorf("end marker with a payload of %d bytes", len(m.Frames[2]))
			}
			return out
		}
		b, err := decodeWireBatch(m.Frames[1], m.Frames[2])
		if err != nil {
			t.Fatalf("replayed batch: %v", err)
		}
		out = append(out, b)
	}
}

func TestAConsumerOfVLLMsFormatReadsEveryKVEventAndReplays(t *testing.T) {
	tests := []struct {
		name, format string
		connect      bool // the sim connects to the consumer's bound SUB socket
		crash        bool // the run ends in an engine crash (AllBlocksCleared)
		topic        string
	}{
		{"array events, the sim binds", KVEventsFormatArray, false, false, "kv@127.0.0.1:8000@sim"},
		{"map events, the sim binds", KVEventsFormatMap, false, true, "kv@127.0.0.1:8000@sim"},
		{"array events, the sim connects to the consumer", KVEventsFormatArray, true, false, "kv@127.0.0.1:8000@sim"},
		{"the default empty topic", KVEventsFormatArray, false, false, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topic := tt.topic
			cfg := fastConfig()
			cfg.KVBlocks = 16 // a small pool: six prompts of 4 blocks evict each other
			cfg.KVEventsTopic, cfg.KVEventsFormat = topic, tt.format
			cfg.KVEventsReplayEndpoint = "tcp://*:0"
			var sub *subscriber
			if tt.connect {
				var ep string
				sub, ep = newSubscriber(t, topic, true, "tcp://127.0.0.1:0")
				cfg.KVEventsEndpoint = ep
			} else {
				cfg.KVEventsEndpoint = "tcp://*:0"
			}
			ts := startServer(t, cfg)
			addr := strings.Replace(ts.e.KVEventsAddr(), "0.0.0.0", "127.0.0.1", 1)
			replayEP := strings.Replace(ts.e.KVEventsReplayAddr(), "0.0.0.0", "127.0.0.1", 1)
			if !tt.connect {
				sub, _ = newSubscriber(t, topic, false, addr)
			}
			prompt := func(i int) string {
				return `{"prompt":"` + strings.Repeat(fmt.Sprintf("w%03d ", i), 30) + `","max_tokens":1}` // 60 tokens: 3 full blocks of 4
			}
			// A PUB socket drops what it sends before a subscription
			// arrives: serve prompts until the consumer hears one.
			var first wireBatch
			for i := 0; ; i++ {
				answerUsage(t, ts, "/v1/completions", prompt(i), nil)
				select {
				case m := <-sub.msgs:
					first = decodeMsg(t, m, topic)
				case <-time.After(20 * time.Millisecond):
					if i > 500 {
						t.Fatal("the consumer heard nothing after 500 prompts")
					}
					continue
				}
				break
			}
			for i := range 12 {
				answerUsage(t, ts, "/v1/completions", prompt(100+i%6), nil)
			}
			if tt.crash {
				resp := ts.post(t, context.Background(), "/v1/completions",
					`{"prompt":"x","prompt_logprobs":1,"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[],"remote_host":"127.0.0.1","remote_port":1}}`, nil)
				if b := readAll(t, resp); resp.StatusCode != http.StatusInternalServerError {
					t.Fatalf("crash request: status %d: %s", resp.StatusCode, b)
				}
			}
			ts.waitKV(t, "every request ended", allFree)

			// Everything before the first message heard comes from the
			// replay; the rest from the stream, in order, none missing.
			model := &cacheModel{blocks: map[uint64]bool{}}
			before := replayFrom(t, replayEP, 0)
			for i, b := range before {
				if b.Seq != int64(i) {
					t.Fatalf("replay from 0: batch %d has seq %d", i, b.Seq)
				}
				if b.Seq < first.Seq {
					model.apply(t, b)
				}
			}
			want := ts.kv(t).CachedBlocks
			last := first
			model.apply(t, first)
			for len(model.blocks) != want || last.Seq < int64(len(before))-1 {
				b := sub.next(t, topic)
				if b.Seq != last.Seq+1 {
					t.Fatalf("batch %d after %d: a message was lost", b.Seq, last.Seq)
				}
				model.apply(t, b)
				last = b
			}
			if model.removed == 0 {
				t.Errorf("no BlockRemoved in %d batches, from a pool of 16 blocks", last.Seq+1)
			}
			if tt.crash && (model.cleared != 1 || len(model.blocks) != 0) {
				t.Errorf("after the crash the consumer saw %d AllBlocksCleared and knows %d blocks, want 1 and 0", model.cleared, len(model.blocks))
			}
			for _, b := range before {
				if b.Rank != 0 || b.TS <= 0 {
					t.Errorf("batch %d: rank %d, ts %v", b.Seq, b.Rank, b.TS)
				}
			}

			// A replay from a later sequence number answers from there on.
			from := last.Seq / 2
			got := replayFrom(t, replayEP, from)
			if len(got) == 0 || got[0].Seq != from || got[len(got)-1].Seq < last.Seq {
				t.Errorf("replay from %d: %d batches, want %d..%d", from, len(got), from, last.Seq)
			}
		})
	}
}

// FuzzKVEventBatch checks that every batch the encoder can make decodes,
// in both formats, into the events it was made of.
func FuzzKVEventBatch(f *testing.F) {
	f.Add(uint64(1), uint64(2), uint32(7), uint8(2), true, 3)
	f.Add(uint64(1<<63), uint64(0), uint32(0), uint8(0), false, 0)
	f.Fuzz(func(t *testing.T, h1, h2 uint64, tok uint32, kind uint8, parent bool, rank int) {
		if rank < 0 {
			rank = -rank
		}
		ev := kvEvent{kind: kvEventKind(kind % 3), hashes: []uint64{h1, h2}, tokens: []uint32{tok, tok + 1, tok, tok}, blockSize: 2}
		if parent {
			ev.parent = &h2
		}
		for _, format := range []string{KVEventsFormatArray, KVEventsFormatMap} {
			payload, err := encodeBatch(1.5, []kvEvent{ev}, rank, format)
			if err != nil {
				t.Fatal(err)
			}
			b, err := decodeWireBatch(make([]byte, 8), payload)
			if err != nil {
				t.Fatalf("%s: %v", format, err)
			}
			if len(b.Events) != 1 || b.Rank != int64(rank) || b.TS != 1.5 {
				t.Fatalf("%s: decoded %+v", format, b)
			}
			got := b.Events[0]
			switch ev.kind {
			case eventBlockStored:
				if got.Type != "BlockStored" || len(got.Hashes) != 2 || got.Hashes[0] != h1 || got.Hashes[1] != h2 ||
					(got.Parent != nil) != parent || len(got.Tokens) != 4 || got.Tokens[0] != uint64(tok) || got.Medium != mediumGPU {
					t.Fatalf("%s: decoded %+v from %+v", format, got, ev)
				}
			case eventBlockRemoved:
				if got.Type != "BlockRemoved" || len(got.Hashes) != 2 || got.Hashes[1] != h2 {
					t.Fatalf("%s: decoded %+v from %+v", format, got, ev)
				}
			default:
				if got.Type != "AllBlocksCleared" {
					t.Fatalf("%s: decoded %+v", format, got)
				}
			}
		}
	})
}

func TestKVEventEndpointsBindOnAWildcardAndMoveByTheDataParallelRank(t *testing.T) {
	tests := []struct {
		ep    string
		rank  int
		binds bool
		want  string
	}{
		{"tcp://*:5557", 0, true, "tcp://*:5557"},
		{"tcp://*:5557", 2, true, "tcp://*:5559"},
		{"tcp://*:0", 2, true, "tcp://*:0"},
		{"tcp://10.0.0.7:5557", 1, false, "tcp://10.0.0.7:5558"},
		{"tcp://[::]:5557", 1, true, "tcp://[::]:5558"},
		{"ipc:///tmp/kv", 3, true, "ipc:///tmp/kv"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s rank %d", tt.ep, tt.rank), func(t *testing.T) {
			got, err := offsetPort(tt.ep, tt.rank)
			if err != nil || got != tt.want || bindsEndpoint(tt.ep) != tt.binds {
				t.Errorf("offsetPort = %q, %v; binds %v; want %q, binds %v", got, err, bindsEndpoint(tt.ep), tt.want, tt.binds)
			}
		})
	}
}

func TestKVEventSettingsThatCannotWorkAreRejected(t *testing.T) {
	tests := []struct {
		name string
		cfg  func(*Config)
	}{
		{"an unknown format", func(c *Config) { c.KVEventsEndpoint, c.KVEventsFormat = "tcp://*:0", "json" }},
		{"a replay endpoint without an endpoint", func(c *Config) { c.KVEventsReplayEndpoint = "tcp://*:0" }},
		{"a negative data parallel rank", func(c *Config) { c.DataParallelRank = -1 }},
		{"an endpoint that is not one", func(c *Config) { c.KVEventsEndpoint = "nowhere" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fastConfig()
			tt.cfg(&cfg)
			if e, err := New(cfg, nil); err == nil {
				e.kv.close()
				t.Errorf("New accepted %+v", cfg)
			}
		})
	}
}
