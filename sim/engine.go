package sim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Engine is one simulated vLLM-like engine: a KV block pool, a FIFO queue,
// a step loop and the HTTP endpoints in front of them.
type Engine struct {
	cfg       Config
	log       *zap.Logger
	id        string
	clock     Clock
	transport kvTransport
	client    *http.Client // for the pull/notify protocol; closed when Run ends
	registry  *prometheus.Registry

	wake chan struct{} // capacity 1: "the inbox has events"

	mu      sync.Mutex
	inbox   []event
	closed  bool // Run ended: no more requests
	seq     uint64
	pool    *blockPool
	live    map[string]*request // waiting .. decoding, by request id
	held    map[string]*request // prefills holding blocks for a decoder, by request id
	waiting []*request          // FIFO
	running []*request          // prefilling, pulling or decoding
	holdDue time.Time           // no hold expires before this; zero: no hold
	// computeFree is when the prefills admitted so far have computed, with
	// MaxNumBatchedTokens (prefillDone); decoding counts the requests decoding
	// at the step's start (itl).
	computeFree time.Time
	decoding    int
	// handshakes holds when the NIXL handshake with each prefiller is (or
	// was) done; an absent peer has not been asked for yet.
	handshakes map[kvPeer]time.Time
	counts     counters
	// kv publishes the prefix cache's events; nil without an endpoint.
	kv      *kvPublisher
	started bool // Run was called

	// SGLang (sglang.go). rooms: a prefiller's bootstrap rooms by id;
	// prealloc: a decoder's requests waiting for their room's KV, with what
	// ends their wait; inflight: the request ids the HTTP layer is serving,
	// the only ones /abort_request acts on (SGLang's rid_to_state).
	boot     *bootstrapServer // a prefiller's; nil otherwise
	rooms    map[uint64]*room
	prealloc map[*request]context.CancelCauseFunc
	inflight map[string]int

	// Mooncake (mooncake.go). transfers: a prefiller's transfers by
	// transfer_id, from the first prefill or claim that names one until its
	// prefill ends without KV or its hold ends; xferGone: the transfer ids
	// that ended so, until their hold timeout has passed, so that a late
	// claim is answered at once instead of waiting for a prefill that will
	// never come.
	transfers map[string]*transfer
	xferGone  map[string]time.Time

	// rank is this engine's data parallel rank; ranks are every rank of the
	// server, ranks[0] the engine New returned (dp.go). Only rank 0's ranks
	// is set.
	rank  int
	ranks []*Engine

	// models are the served model names, the default first, and loras the
	// adapters (models.go); store keeps finished Responses API answers,
	// one for every rank (responses.go); vocab the text of token ids the
	// engine tokenized, for /detokenize (pooling.go).
	models []string
	loras  []loraModule
	store  *responseStore
	vocab  *vocabulary
	// tok is what prompts are tokenized with (tokenizer.go).
	tok tokenizer
	// drain is the drain state (drain.go), and die what the die-after
	// fault calls (server.go): nil when no Server runs the engine.
	drain *drainer
	die   func()
}

type counters struct {
	requests       int
	aborted        int
	expired        int
	lateEvents     int
	doubleFrees    int
	heartbeats     int
	heartbeatsSent int
	crashes        int
	holds          int
	remotePrefills int
	prefixQueries  int // prompt tokens looked up in the prefix cache
	prefixHits     int // of those, tokens the cache held
	pulledBlocks   int // blocks a decoder pulled from prefillers
	computed       int // prompt tokens computed here: uncached, not pulled
	// externalQueries and externalHits are the prompt tokens looked up in the
	// CPU tier (every prompt that computes, with one) and those reloaded from it.
	externalQueries int
	externalHits    int
	loadFailures    int // Mooncake decodes whose transfer the prefiller could not give
	pooling         int // pooling requests (pooling.go) that passed validation
	poolingAborted  int // of those, ended by their client leaving
	// priorities counts requests by their priority: the scheduler's, and
	// the pooling requests'.
	priorities map[int]int
}

// KVStats is a snapshot of the engine's KV pool and request counters, the
// body of GET /debug/kv. BlocksFree+BlocksInUse+BlocksHeld == BlocksTotal
// always holds; DoubleFreeAttemptsTotal must stay 0.
type KVStats struct {
	BlocksTotal int `json:"blocks_total"`
	BlocksFree  int `json:"blocks_free"`
	// BlocksHeld are held by finished prefills for a decoder's pull.
	BlocksHeld int `json:"blocks_held"`
	// BlocksInUse belong to waiting-for-pull, prefilling or decoding
	// requests. A block shared by several requests (a cached prefix) counts
	// once; a cached block nobody references counts as free.
	BlocksInUse int `json:"blocks_in_use"`
	// CachedBlocks are in the prefix cache: referenced by requests or not.
	CachedBlocks int `json:"cached_blocks"`
	// PrefixCacheQueriesTotal counts prompt tokens looked up in the prefix
	// cache (one lookup per admitted request), and PrefixCacheHitsTotal the
	// tokens of those found cached, as vllm:prefix_cache_queries_total and
	// vllm:prefix_cache_hits_total.
	PrefixCacheQueriesTotal int `json:"prefix_cache_queries_total"`
	PrefixCacheHitsTotal    int `json:"prefix_cache_hits_total"`
	// KVBlocksPulledTotal counts the blocks this engine pulled from
	// prefillers as a decoder: those its own cache lacked.
	KVBlocksPulledTotal int `json:"kv_blocks_pulled_total"`
	// PromptTokensComputedTotal counts the prompt tokens this engine computed
	// itself: those its prefix cache lacked, in a prefill or an aggregated
	// request (or a decode whose prefiller sent no KV), never those a decoder
	// pulled. Across a P/D fleet it is the prefill work the routing left. It
	// counts with the prefix-cache counters: not with --prefix-cache=false.
	PromptTokensComputedTotal int `json:"prompt_tokens_computed_total"`
	// ExternalPrefixCacheQueriesTotal counts, with a CPU tier, the prompt
	// tokens of the requests that looked it up (those that compute their
	// prompt), and ExternalPrefixCacheHitsTotal the tokens reloaded from it,
	// as vllm:external_prefix_cache_queries_total and
	// vllm:external_prefix_cache_hits_total count what vLLM's KV connector
	// loads. A prompt's tokens split into PrefixCacheHitsTotal (on the GPU),
	// ExternalPrefixCacheHitsTotal (reloaded from CPU) and
	// PromptTokensComputedTotal.
	ExternalPrefixCacheQueriesTotal int `json:"external_prefix_cache_queries_total"`
	ExternalPrefixCacheHitsTotal    int `json:"external_prefix_cache_hits_total"`
	// CPUBlocksTotal is the CPU tier's size (0: none), CPUCachedBlocks the
	// blocks it holds.
	CPUBlocksTotal  int `json:"cpu_blocks_total"`
	CPUCachedBlocks int `json:"cpu_cached_blocks"`
	HeldRequests    int `json:"held_requests"`
	// RunningRequests hold a running slot and KV blocks: prefilling, pulling
	// KV (or waiting for the NIXL handshake before the pull) or decoding.
	// /metrics reports it as vllm:num_requests_running (sglang:num_running_reqs).
	RunningRequests int `json:"running_requests"`
	// WaitingRequests are submitted and wait for KV blocks or a running
	// slot, those not yet seen by a scheduler step included; /metrics reports
	// it as vllm:num_requests_waiting (sglang:num_queue_reqs). An SGLang
	// decode waiting for its room is in RoomsWaiting instead.
	WaitingRequests int `json:"waiting_requests"`
	// RequestsTotal counts requests the scheduler accepted.
	RequestsTotal int `json:"requests_total"`
	// AbortedTotal counts aborts that ended a live request or freed a hold.
	AbortedTotal int `json:"aborted_total"`
	// ExpiredTotal counts holds freed because their lease (KVHoldTimeout,
	// renewed by heartbeats) ran out, as vllm:nixl_num_kv_expired_reqs_total.
	ExpiredTotal int `json:"expired_total"`
	// LateEventsTotal counts aborts, notifications and heartbeats for
	// requests that had already finished, expired or were unknown: ignored,
	// by design.
	LateEventsTotal         int `json:"late_events_total"`
	DoubleFreeAttemptsTotal int `json:"double_free_attempts_total"`
	// HeartbeatsTotal counts lease renewals this engine applied as a
	// prefiller: one per held request id in a heartbeat it received.
	HeartbeatsTotal int `json:"heartbeats_total"`
	// HeartbeatsSentTotal counts request ids this engine sent in heartbeats
	// that a prefiller accepted, as a decoder.
	HeartbeatsSentTotal int `json:"heartbeats_sent_total"`
	// EngineCrashesTotal counts the engine's deaths: a decode asking for
	// prompt logprobs (vLLM #50792) fails every request the engine has.
	EngineCrashesTotal int `json:"engine_crashes_total"`
	// HoldsTotal counts prefills that ended holding KV for a decoder, as a
	// prefiller: one per engine request, so a fan-out's children count too.
	// An SGLang prefiller counts each room whose prefill ended holding KV.
	HoldsTotal int `json:"holds_total"`
	// RemotePrefillRequestsTotal counts HTTP requests that arrived carrying
	// kv_transfer_params with do_remote_prefill true, as a decoder: one per
	// HTTP request whose body parsed, whatever its answer (a rejection or an
	// injected fault included). An SGLang decoder counts the requests that
	// carry a bootstrap_room, one per HTTP request however many rooms.
	RemotePrefillRequestsTotal int `json:"remote_prefill_requests_total"`
	// RoomsWaiting counts, on an SGLang decoder, the rooms its requests wait
	// for: asked of the prefiller's bootstrap server, KV not yet ready. A
	// room leaves the count when its KV is ready (the request then queues
	// for blocks and pulls) or its wait ends (abort, waiting timeout, client
	// gone, prefill gone, shutdown).
	RoomsWaiting int `json:"rooms_waiting"`
	// RoomsHeld counts, on an SGLang prefiller, the rooms whose prefill
	// ended holding KV and whose transfer has not started (no decoder pulled
	// yet): the rooms an abort frees, and that NIXL holds until the process
	// restarts when nobody aborts them. A room being transferred is still in
	// HeldRequests and BlocksHeld until the decoder's notification.
	RoomsHeld int `json:"rooms_held"`
	// TransfersWaiting counts, on a Mooncake decoder, the decodes waiting
	// for their transfer's prefill on the prefiller (mooncake.go).
	TransfersWaiting int `json:"transfers_waiting"`
	// KVLoadFailuresTotal counts, on a Mooncake decoder, the decodes whose
	// transfer the prefiller did not have (unknown, expired, aborted, pulled
	// already) or that waited past WaitingTimeout: each failed with a 500
	// kv_transfer_failed or, with KVLoadFailurePolicy "recompute", computed
	// its prompt itself.
	KVLoadFailuresTotal int `json:"kv_load_failures_total"`
	// PoolingRequestsTotal counts the pooling-style requests this server
	// took (POST /v1/embeddings, /pooling, /v1/score, /score, /v1/rerank,
	// /rerank, /v2/rerank, /detokenize, /v1/audio/transcriptions; pooling.go)
	// once their body and model were valid, and PoolingAbortedTotal those
	// of them whose client left before the answer, which stopped them:
	// /metrics pdproxy_sim_pooling_requests_total and
	// pdproxy_sim_pooling_aborted_total.
	PoolingRequestsTotal int `json:"pooling_requests_total"`
	PoolingAbortedTotal  int `json:"pooling_aborted_total"`
	// Priorities counts the requests seen by the body's priority (vLLM's,
	// lower first; 0 when absent), keyed by the priority in decimal:
	// generation requests the scheduler accepted and pooling requests.
	Priorities map[string]int `json:"priorities"`
	// Ranks are the data parallel ranks' own numbers, one per rank (one
	// without data parallelism); the fields above are their sums.
	Ranks []RankStats `json:"ranks"`
}

// New builds an engine; call Run to start its scheduler and serve Handler.
// With DataParallelSize N > 1 it is rank 0 of N ranks behind one Handler
// (dp.go).
func New(cfg Config, logger *zap.Logger) (*Engine, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	tok, err := newTokenizer(cfg.Tokenizer)
	if err != nil {
		return nil, err
	}
	e, err := newRank(cfg, logger, 0)
	if err != nil {
		return nil, err
	}
	e.ranks = []*Engine{e}
	store, vocab, drain := newResponseStore(maxStoredResponses), newVocabulary(), newDrainer()
	for r := 1; r < cfg.DataParallelSize; r++ {
		rc := cfg
		rc.DataParallelRank = cfg.DataParallelRank + r
		if cfg.EngineID != "" {
			rc.EngineID = cfg.EngineID + "-dp" + strconv.Itoa(r)
		}
		re, err := newRank(rc, logger, r)
		if err != nil {
			e.closeUnstarted()
			return nil, err
		}
		e.ranks = append(e.ranks, re)
	}
	for _, r := range e.ranks {
		r.store, r.vocab, r.drain, r.tok = store, vocab, drain, tok
	}
	return e, nil
}

// closeUnstarted releases the sockets New bound for engines whose Run never ran.
func (e *Engine) closeUnstarted() {
	for _, r := range e.ranks {
		if r.kv != nil {
			r.kv.close()
		}
	}
	if e.boot != nil {
		_ = e.boot.ln.Close()
	}
}

// newRank builds data parallel rank r of an engine; rank 0 owns the
// bootstrap server, which serves every rank.
func newRank(cfg Config, logger *zap.Logger, rank int) (*Engine, error) {
	var err error
	id := cfg.EngineID
	if id == "" {
		var b [6]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand panics instead)
		id = "sim-" + cfg.Role + "-" + hex.EncodeToString(b[:])
	}
	logger = logger.With(zap.String("engine_id", id))
	if cfg.DataParallelSize > 1 {
		logger = logger.With(zap.Int("dp_rank", rank))
	}
	var kv *kvPublisher
	if cfg.KVEventsEndpoint != "" {
		// Bound here, as the bootstrap server, so that the address is known
		// before Run; Run serves and closes it.
		if kv, err = newKVPublisher(cfg, logger); err != nil {
			return nil, err
		}
	}
	client := newTransferClient()
	var boot *bootstrapServer
	if rank == 0 && (cfg.Protocol == ProtocolSGLang || cfg.Protocol == ProtocolMooncake) && cfg.Role == "prefill" {
		// Bound here, not in Run, so that /server_info reports the port from
		// the start; Run serves it and closes it.
		if boot, err = listenBootstrap(cfg.BootstrapHost, cfg.BootstrapPort); err != nil {
			if kv != nil {
				kv.close()
			}
			return nil, err
		}
	}
	e := &Engine{
		cfg:    cfg,
		log:    logger.With(zap.String("role", cfg.Role)),
		id:     id,
		rank:   rank,
		clock:  cfg.Clock,
		client: client,
		wake:   make(chan struct{}, 1),
		pool:   newBlockPool(cfg.KVBlocks, !cfg.DisablePrefixCache, cfg.CPUOffloadBlocks, cfg.SlidingWindow, cfg.BlockSize),
		kv:     kv,
		live:   make(map[string]*request),
		held:   make(map[string]*request),

		handshakes: make(map[kvPeer]time.Time),
		boot:       boot,
		rooms:      make(map[uint64]*room),
		prealloc:   make(map[*request]context.CancelCauseFunc),
		inflight:   make(map[string]int),
		transfers:  make(map[string]*transfer),
		xferGone:   make(map[string]time.Time),
	}
	e.models = splitModels(cfg.Model)
	e.loras, _ = parseLoRAModules(cfg.LoRAModules) // checked by withDefaults
	e.counts.priorities = make(map[int]int)
	e.transport = &httpTransport{client: client, stopped: e.stopped}
	e.registry = e.newRegistry()
	return e, nil
}

func (e *Engine) stopped() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

// ID is the engine id this engine puts in kv_transfer_params.
func (e *Engine) ID() string { return e.id }

// BootstrapPort is the port an SGLang or Mooncake prefiller's bootstrap server listens on (the
// one Config.BootstrapPort named, or the free port 0 picked); 0 for other engines.
func (e *Engine) BootstrapPort() int {
	if e.boot == nil {
		return 0
	}
	return e.boot.port()
}

// KVEventsAddr is where the engine publishes KV events: the bound address
// (tcp://host:port, the port picked when the endpoint's was 0), or the
// endpoint it connects to; "" without KV events.
func (e *Engine) KVEventsAddr() string {
	if e.kv == nil {
		return ""
	}
	return e.kv.addr()
}

// KVEventsAddrs is KVEventsAddr of each data parallel rank, rank 0 first.
func (e *Engine) KVEventsAddrs() []string {
	out := make([]string, len(e.ranks))
	for i, r := range e.ranks {
		out[i] = r.KVEventsAddr()
	}
	return out
}

// KVEventsReplayAddr is the bound address of the replay socket, or "".
func (e *Engine) KVEventsReplayAddr() string {
	if e.kv == nil {
		return ""
	}
	return e.kv.replayAddr()
}

// newRequest turns a parsed API request into an engine request.
func (e *Engine) newRequest(rid string, a *apiRequest) (*request, error) {
	if e.cfg.MaxModelLen > 0 && a.promptTokens > e.cfg.MaxModelLen {
		return nil, badRequest("prompt_too_long", "the prompt (length %d) is longer than the maximum model length of %d", a.promptTokens, e.cfg.MaxModelLen)
	}
	need := (a.promptTokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize
	if need > e.cfg.KVBlocks {
		return nil, badRequest("prompt_too_long", "prompt of %d tokens needs %d KV blocks, the pool has %d", a.promptTokens, need, e.cfg.KVBlocks)
	}
	r := &request{
		rid:          rid,
		kind:         a.kind,
		promptTokens: a.promptTokens,
		maxTokens:    a.maxTokens,
		minTokens:    a.minTokens,
		ignoreEOS:    a.ignoreEOS,
		priority:     a.priority,
		remote:       a.kv,
		crashes:      a.crashesDecoder,
		needBlocks:   need,
		hash:         ridHash(e.cfg.Seed, rid),
		ready:        make(chan struct{}, 1),
	}
	if a.byPrefix && len(a.tokens) > 0 {
		r.byPrefix = true
		r.tokState = prefixState(a.model, a.seeded, a.seed, a.tokens[0])
	}
	if len(a.tokens) > 0 && len(a.tokens[0]) == a.promptTokens && !e.cfg.DisablePrefixCache {
		r.tokens = a.tokens[0]
		r.key = e.cacheKeyOf(a)
		r.blockHashes = blockHashes(r.tokens, e.cfg.BlockSize, r.key)
	}
	if a.mc != nil {
		// Nothing to pull until the prefiller has given the transfer.
		r.mc, r.remote = a.mc, &kvTransferParams{DoRemotePrefill: true}
	}
	r.xferID = a.xferID
	if r.remote != nil && r.remote.RemoteRequestID == "" {
		// Older vLLM versions name the prefiller's request by the shared X-Request-Id.
		r.remote.RemoteRequestID = rid
	}
	return r, nil
}

// enqueue hands an event to the next step.
func (e *Engine) enqueue(ev event) error {
	e.mu.Lock()
	err := e.enqueueLocked(ev)
	e.mu.Unlock()
	if err == nil {
		e.wakeUp()
	}
	return err
}

// enqueueLocked is enqueue for a caller holding e.mu, which then calls wakeUp.
func (e *Engine) enqueueLocked(ev event) error {
	if e.closed && ev.kind == evAdd {
		return errStopped
	}
	if ev.kind == evAdd {
		e.seq++
		ev.req.seq = e.seq
	}
	e.inbox = append(e.inbox, ev)
	return nil
}

func (e *Engine) wakeUp() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// countRemotePrefill counts a decode request that arrived with kv_transfer_params.
func (e *Engine) countRemotePrefill() {
	e.mu.Lock()
	e.counts.remotePrefills++
	e.mu.Unlock()
}

func (e *Engine) submit(r *request) error { return e.enqueue(event{kind: evAdd, req: r}) }

// abortRequest aborts r because its own client went away. Like vLLM, it is a
// no-op once r finished, including when r finished into a hold (race R1).
func (e *Engine) abortRequest(r *request) { _ = e.enqueue(event{kind: evAbort, req: r}) }

// abortRID is the explicit /abort_request: it also frees a held request.
func (e *Engine) abortRID(rid string) { _ = e.enqueue(event{kind: evAbortRID, rid: rid}) }

// finishedSending is the prefiller side of a decoder's notification.
func (e *Engine) finishedSending(rid string) { e.transferEnded(rid, "") }

// transferEnded is finishedSending with the outcome a decoder reports for
// an SGLang transfer: "" read, outcomeFailed.
func (e *Engine) transferEnded(rid, outcome string) {
	_ = e.enqueue(event{kind: evFinishedSending, rid: rid, outcome: outcome})
}

// finishedReceiving is the decoder side: the pull of r ended with err.
func (e *Engine) finishedReceiving(r *request, err error) {
	_ = e.enqueue(event{kind: evFinishedReceving, req: r, err: err})
}

// CloseIdleConnections drops the idle keep-alive connections of the engine's pull/notify
// client (a decoder keeps some open to its prefillers); they are redialled on demand.
func (e *Engine) CloseIdleConnections() {
	for _, r := range e.ranks {
		r.client.CloseIdleConnections()
	}
}
