package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// KV events, in vLLM's wire format (vllm/distributed/kv_events.py), so that
// a consumer written for vLLM reads the sim unchanged:
//
//   - a ZMQ PUB socket on KVEventsEndpoint, bound when the endpoint holds a
//     "*" and connected otherwise (to a consumer's bound SUB socket); data
//     parallel rank r uses the endpoint's port + r;
//   - one message per scheduler step that changed the cache, three frames:
//     [topic, sequence number as 8 bytes big-endian, msgpack payload], the
//     sequence counting from 0;
//   - the payload is an event batch [timestamp (float seconds), [events],
//     data_parallel_rank];
//   - each event is tagged by its class name: with format "array" (vLLM's
//     msgspec array_like structs) an array with the tag first,
//     ["BlockStored", block_hashes, parent_block_hash, token_ids,
//     block_size, lora_id, medium, lora_name, extra_keys, group_idx,
//     kv_cache_spec_kind, kv_cache_spec_sliding_window], ["BlockRemoved",
//     block_hashes, medium, group_idx], ["AllBlocksCleared"]; with format
//     "map" (vLLM PR #42892) a map of the same fields and "type": the tag;
//   - block hashes are uint64, parent_block_hash nil for a prompt's first
//     block, medium "GPU", or "CPU" for the CPU tier's blocks
//     (Config.CPUOffloadBlocks);
//   - a LoRA adapter's blocks carry lora_name (the adapter's name) and
//     lora_id (its place in --lora-modules, from 1), nil for the base model;
//     extra_keys has one entry per block, the tuple of what the block's hash
//     was keyed by beyond its tokens (the LoRA name, then, in a prompt's
//     first block, the cache_salt) or nil (vllm/v1/core/kv_cache_utils.py,
//     generate_block_hash_extra_keys);
//   - group_idx is the KV cache group, 0 (kv_cache_spec_kind
//     "full_attention") or, with Config.SlidingWindow, 1 ("sliding_window",
//     kv_cache_spec_sliding_window the window; window.go);
//   - an optional ROUTER socket on KVEventsReplayEndpoint (always bound)
//     answers a request whose last frame is a start sequence number (8 bytes
//     big-endian; a REQ client's empty delimiter frame before it is kept in
//     the answer's envelope) with one [seq, payload] message per batch still
//     buffered from that number on, then [-1 as 8 bytes, empty payload].
//
// BlockStored is published when a prompt's full blocks are cached (its
// prefill computed them, or a decoder pulled them), BlockRemoved when a
// cached block is evicted for a new allocation, AllBlocksCleared when the
// engine crashes (vLLM #50792: its GPU memory is gone, and the CPU tier with
// the process).
//
// With a CPU tier, a block evicted from the GPU is published as vLLM's
// OffloadingConnector publishes a CPU store with self-describing events
// (kv_connector_extra_config self_describing_kv_events): BlockStored with
// medium "CPU" and the block's own hash, parent hash, tokens and block size,
// then the GPU's BlockRemoved (medium "GPU"), in that order in one batch so
// that a consumer never sees the block held nowhere; a block the CPU tier
// drops is a BlockRemoved with medium "CPU". A block reloaded from CPU is
// stored on the GPU again (BlockStored, medium "GPU") when its prompt is
// computed, and keeps its CPU copy, as vLLM's offloading manager does.

// kvEventKind is which of vLLM's three events a kvEvent is.
type kvEventKind uint8

const (
	eventBlockStored kvEventKind = iota
	eventBlockRemoved
	eventAllBlocksCleared
)

// kvEvent is one change of the prefix cache.
type kvEvent struct {
	kind      kvEventKind
	hashes    []uint64
	parent    *uint64 // BlockStored: nil for a prompt's first block
	tokens    []uint32
	blockSize int
	medium    string // "" is the GPU
	// BlockStored: the adapter's name and id, "" and 0 for the base model, and each
	// block's extra keys (cacheKey.extra), given when hasExtra.
	lora     string
	loraID   int
	extra    [][]any
	hasExtra bool
	// group is the KV cache group, windowGroupIdx for the sliding-window group, whose
	// window (in tokens) a BlockStored gives.
	group  int
	window int
}

// keyed sets ev's LoRA and the extra keys of its n blocks, the first of them block first of
// its prompt, for a request keyed by k.
func (ev *kvEvent) keyed(k cacheKey, first, n int) {
	ev.lora, ev.loraID, ev.hasExtra = k.lora, k.loraID, true
	for i := range n {
		ev.extra = append(ev.extra, k.extra(first+i))
	}
}

const (
	// mediumGPU and mediumCPU are vLLM's MEDIUM_GPU and MEDIUM_CPU.
	mediumGPU = "GPU"
	mediumCPU = "CPU"
	// replayBuffer is how many batches the replay socket can answer, as
	// vLLM's buffer_steps.
	replayBuffer = 10000
	// maxPendingBatches bounds the batches waiting for the socket, as vLLM's
	// max_queue_size; more are dropped and logged.
	maxPendingBatches = 100000
)

// encodeBatch is the msgpack payload of one batch.
func encodeBatch(ts float64, events []kvEvent, rank int, format string) ([]byte, error) {
	evs := make([]any, len(events))
	for i, ev := range events {
		evs[i] = eventValue(ev, format)
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true)
	if err := enc.Encode([]any{ts, evs, rank}); err != nil {
		return nil, fmt.Errorf("encode kv event batch: %w", err)
	}
	return buf.Bytes(), nil
}

func eventValue(ev kvEvent, format string) any {
	hashes := ev.hashes
	if hashes == nil {
		hashes = []uint64{}
	}
	medium := ev.medium
	if medium == "" {
		medium = mediumGPU
	}
	switch ev.kind {
	case eventBlockStored:
		var parent any
		if ev.parent != nil {
			parent = *ev.parent
		}
		tokens := ev.tokens
		if tokens == nil {
			tokens = []uint32{}
		}
		var lora, loraID, extra, window any
		if ev.lora != "" {
			lora, loraID = ev.lora, ev.loraID
		}
		if ev.hasExtra {
			keys := make([]any, len(ev.extra))
			for i, k := range ev.extra {
				if k != nil {
					keys[i] = k
				}
			}
			extra = keys
		}
		kind := "full_attention"
		if ev.group == windowGroupIdx {
			kind, window = "sliding_window", ev.window
		}
		if format == KVEventsFormatMap {
			m := map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
				"token_ids": tokens, "block_size": ev.blockSize, "lora_id": loraID, "medium": medium, "lora_name": lora,
				"group_idx": ev.group, "kv_cache_spec_kind": kind}
			// msgspec's omit_defaults leaves out the fields at their default, None.
			if extra != nil {
				m["extra_keys"] = extra
			}
			if window != nil {
				m["kv_cache_spec_sliding_window"] = window
			}
			return m
		}
		return []any{"BlockStored", hashes, parent, tokens, ev.blockSize, loraID, medium, lora, extra, ev.group, kind, window}
	case eventBlockRemoved:
		if format == KVEventsFormatMap {
			return map[string]any{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": ev.group}
		}
		return []any{"BlockRemoved", hashes, medium, ev.group}
	default:
		if format == KVEventsFormatMap {
			return map[string]any{"type": "AllBlocksCleared"}
		}
		return []any{"AllBlocksCleared"}
	}
}

// kvEventSource is one data parallel rank's publisher as vLLM's
// GET /kv_event_sources lists it (vLLM PR #55844).
type kvEventSource struct {
	Rank     int     `json:"data_parallel_rank"`
	Endpoint string  `json:"endpoint"`
	Replay   *string `json:"replay_endpoint"`
	Topic    string  `json:"topic"`
}

// handleKVEventSources answers where each rank's publisher is, as vLLM does since it binds
// port 0 (tcp://*:0: every rank a free port of its own, known only once bound): a JSON array
// of the ranks' bound endpoints, rank 0 first. vLLM binds the node's address rather than a
// wildcard; the sim, bound on a wildcard, reports the address the request came in on.
func (e *Engine) handleKVEventSources(w http.ResponseWriter, r *http.Request) {
	local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	out := []kvEventSource{}
	for i, rank := range e.ranks {
		if rank.kv == nil {
			continue
		}
		s := kvEventSource{Rank: i, Endpoint: reachable(rank.kv.addr(), local), Topic: string(rank.kv.topic)}
		if a := rank.kv.replayAddr(); a != "" {
			a = reachable(a, local)
			s.Replay = &a
		}
		out = append(out, s)
	}
	writeJSON(w, http.StatusOK, out)
}

// reachable is a bound tcp endpoint with its wildcard host put as local's.
func reachable(ep string, local net.Addr) string {
	host, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	ta, ok := local.(*net.TCPAddr)
	if err != nil || !ok || !strings.HasPrefix(ep, "tcp://") {
		return ep
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
		return ep
	}
	return "tcp://" + net.JoinHostPort(ta.IP.String(), port)
}

// bindsEndpoint reports whether a ZMQ endpoint is bound rather than
// connected to, by vLLM's rule: it holds a wildcard.
func bindsEndpoint(ep string) bool {
	return strings.Contains(ep, "*") || strings.Contains(ep, "::") || strings.HasPrefix(ep, "ipc://") || strings.HasPrefix(ep, "inproc://")
}

// offsetPort moves a tcp endpoint's port by a data parallel rank.
func offsetPort(ep string, rank int) (string, error) {
	if rank == 0 || !strings.HasPrefix(ep, "tcp://") {
		return ep, nil
	}
	i := strings.LastIndex(ep, ":")
	port, err := strconv.Atoi(ep[i+1:])
	if err != nil {
		return "", fmt.Errorf("kv events endpoint %q: port: %w", ep, err)
	}
	if port == 0 {
		return ep, nil // every rank binds a free port of its own
	}
	return ep[:i+1] + strconv.Itoa(port+rank), nil
}

// pendingBatch is a batch the step handed over, not yet sent.
type pendingBatch struct {
	ts     float64
	events []kvEvent
}

// sentBatch is a sent batch, kept for replay.
type sentBatch struct {
	seq     uint64
	payload []byte
}

// kvPublisher publishes the engine's KV events. The step hands it batches
// (publish never blocks the scheduler); its loop, which the engine's Run
// owns, encodes and sends them; its replay loop answers replay requests.
type kvPublisher struct {
	log      *zap.Logger
	topic    []byte
	format   string
	rank     int
	endpoint string // after the rank's offset
	replayEP string

	pub    zmq4.Socket
	replay zmq4.Socket // nil without a replay endpoint

	wake chan struct{} // capacity 1: "pending has batches"

	mu      sync.Mutex
	pending []pendingBatch
	history []sentBatch // the last replayBuffer batches, oldest first
	seq     uint64
	dropped int
	// queued and sent count the batches publish queued and flush has sent (or failed
	// to encode): equal, every step's events so far are in the replay history.
	queued, sent uint64
}

// newKVPublisher makes the sockets and binds those that bind, so that the
// bound addresses are known before Run; connecting waits for Run.
func newKVPublisher(cfg Config, log *zap.Logger) (*kvPublisher, error) {
	ep, err := offsetPort(cfg.KVEventsEndpoint, cfg.DataParallelRank)
	if err != nil {
		return nil, err
	}
	replayEP, err := offsetPort(cfg.KVEventsReplayEndpoint, cfg.DataParallelRank)
	if err != nil {
		return nil, err
	}
	p := &kvPublisher{
		log: log, topic: []byte(cfg.KVEventsTopic), format: cfg.KVEventsFormat, rank: cfg.DataParallelRank,
		endpoint: ep, replayEP: replayEP, wake: make(chan struct{}, 1),
	}
	// Sockets live until Run closes them, not for one call: their context
	// is not a request's.
	opts := []zmq4.Option{zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(100 * time.Millisecond)}
	if !bindsEndpoint(ep) {
		// A connecting publisher redials a consumer that went away. Not a bound one:
		// zmq4 would "reconnect" it by dialling its own listening endpoint whenever a
		// subscriber leaves.
		opts = append(opts, zmq4.WithAutomaticReconnect(true))
	}
	p.pub = zmq4.NewPub(context.Background(), opts...)
	if bindsEndpoint(ep) {
		if err := p.pub.Listen(ep); err != nil {
			p.pub.Close()
			return nil, fmt.Errorf("kv events: bind %s: %w", ep, err)
		}
	}
	if replayEP != "" {
		p.replay = zmq4.NewRouter(context.Background(), zmq4.WithTimeout(5*time.Second))
		if err := p.replay.Listen(replayEP); err != nil {
			p.pub.Close()
			p.replay.Close()
			return nil, fmt.Errorf("kv events: bind replay %s: %w", replayEP, err)
		}
	}
	return p, nil
}

// addr is where the PUB socket is bound, tcp://host:port, or the endpoint
// it connects to.
func (p *kvPublisher) addr() string {
	if a := p.pub.Addr(); a != nil && bindsEndpoint(p.endpoint) {
		return "tcp://" + a.String()
	}
	return p.endpoint
}

func (p *kvPublisher) replayAddr() string {
	if p.replay == nil || p.replay.Addr() == nil {
		return ""
	}
	return "tcp://" + p.replay.Addr().String()
}

// publish queues one step's events. The caller holds Engine.mu.
func (p *kvPublisher) publish(now time.Time, events []kvEvent) {
	p.mu.Lock()
	if len(p.pending) >= maxPendingBatches {
		p.dropped++
		p.mu.Unlock()
		return
	}
	p.pending = append(p.pending, pendingBatch{ts: float64(now.UnixNano()) / 1e9, events: events})
	p.queued++
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// run sends batches until ctx is done, then sends what is left and closes
// the sockets, which ends the replay loop. It connects first when the
// endpoint is not bound, retrying until the consumer is there.
func (p *kvPublisher) run(ctx context.Context) {
	var wg sync.WaitGroup
	defer func() {
		p.flush()
		p.close()
		wg.Wait()
	}()
	if p.replay != nil {
		wg.Go(p.serveReplay)
	}
	if !bindsEndpoint(p.endpoint) {
		dialed := make(chan error, 1)
		// Dial retries until it connects or the socket closes; the socket
		// closes when this function returns, so the goroutine ends then.
		wg.Go(func() { dialed <- p.pub.Dial(p.endpoint) })
		select {
		case <-ctx.Done():
			return
		case err := <-dialed:
			if err != nil {
				p.log.Error("kv events: connect failed, no events will be published", zap.String("endpoint", p.endpoint), zap.Error(err))
				<-ctx.Done()
				return
			}
		}
	}
	p.log.Info("kv events publisher running", zap.String("endpoint", p.addr()), zap.String("replay_endpoint", p.replayAddr()),
		zap.String("topic", string(p.topic)), zap.String("format", p.format))
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
		}
		p.flush()
	}
}

// close closes the sockets.
func (p *kvPublisher) close() {
	p.pub.Close()
	if p.replay != nil {
		p.replay.Close()
	}
}

// flush sends every pending batch.
func (p *kvPublisher) flush() {
	p.mu.Lock()
	batches := p.pending
	p.pending = nil
	if p.dropped > 0 {
		p.log.Warn("kv events: batches dropped, the publisher fell behind", zap.Int("batches", p.dropped))
		p.dropped = 0
	}
	p.mu.Unlock()
	for _, b := range batches {
		payload, err := encodeBatch(b.ts, b.events, p.rank, p.format)
		if err != nil {
			p.log.Error("kv events: encode", zap.Error(err))
			p.mu.Lock()
			p.sent++
			p.mu.Unlock()
			continue
		}
		p.mu.Lock()
		seq := p.seq
		p.seq++
		p.sent++
		p.history = append(p.history, sentBatch{seq: seq, payload: payload})
		if len(p.history) > replayBuffer {
			p.history = p.history[len(p.history)-replayBuffer:]
		}
		p.mu.Unlock()
		var seqb [8]byte
		binary.BigEndian.PutUint64(seqb[:], seq)
		if err := p.pub.Send(zmq4.NewMsgFrom(p.topic, seqb[:], payload)); err != nil {
			p.log.Warn("kv events: send", zap.Uint64("seq", seq), zap.Error(err))
		}
	}
}

// serveReplay answers replay requests until the socket closes.
func (p *kvPublisher) serveReplay() {
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			return // closed by run
		}
		if len(msg.Frames) < 2 || len(msg.Frames[len(msg.Frames)-1]) != 8 {
			p.log.Warn("kv events: invalid replay request ignored", zap.Int("frames", len(msg.Frames)))
			continue
		}
		// [identity, (empty delimiter,) start]: the answer keeps the envelope.
		envelope := msg.Frames[:len(msg.Frames)-1]
		start := binary.BigEndian.Uint64(msg.Frames[len(msg.Frames)-1])
		p.mu.Lock()
		var due []sentBatch
		for _, b := range p.history {
			if b.seq >= start {
				due = append(due, b)
			}
		}
		p.mu.Unlock()
		send := func(seq []byte, payload []byte) error {
			frames := append(append([][]byte{}, envelope...), seq, payload)
			return p.replay.Send(zmq4.NewMsgFrom(frames...))
		}
		var seqb [8]byte
		for _, b := range due {
			binary.BigEndian.PutUint64(seqb[:], b.seq)
			if err := send(seqb[:], b.payload); err != nil {
				p.log.Warn("kv events: replay send", zap.Error(err))
				break
			}
		}
		end := make([]byte, 8)
		binary.BigEndian.PutUint64(end, ^uint64(0)) // -1, two's complement
		if err := send(end, []byte{}); err != nil {
			p.log.Warn("kv events: replay end marker", zap.Error(err))
		}
	}
}
