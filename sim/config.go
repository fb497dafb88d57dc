package sim

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// Config describes one simulated engine. Start from DefaultConfig: in a
// Config built by hand, zero sizes and names take their defaults, but zero
// durations mean zero (no prefill time, no inter-token latency), which is
// what benchmarks want.
type Config struct {
	// Protocol is the prefill/decode protocol the engine speaks: "vllm"
	// (default; kv_transfer_params, prefill then decode) or "sglang" (both
	// legs at once, paired by a bootstrap room on the prefiller; see
	// sglang.go) or "mooncake" (vLLM's MooncakeConnector: both legs at once,
	// paired by a transfer_id; see mooncake.go). An "sglang" or "mooncake"
	// engine needs Role "prefill" or "decode".
	Protocol string
	// Role is "prefill", "decode" or "both" (default). With the vllm
	// protocol it is informational: every role serves every request kind, as
	// a vLLM server with a NixlConnector in kv_both mode does. With sglang it
	// is the server's --disaggregation-mode: what a request carrying a
	// bootstrap_room is. It appears in the engine id and logs.
	Role string
	// Model is the served model names, comma-separated as vLLM's
	// --served-model-name may list several: /v1/models lists them all, a
	// request naming none gets the first, which is also the model_name metric
	// label, and a request naming another gets vLLM's 404 (models.go);
	// default "sim".
	Model string
	// LoRAModules is vLLM's --lora-modules, name=path,name=path: adapters
	// served as models, listed by /v1/models with the first model as their
	// parent. Empty: none.
	LoRAModules string
	// EmbeddingDim is the size of the vectors POST /v1/embeddings and
	// POST /pooling answer (pooling.go); default 16.
	EmbeddingDim int
	// SchedulingPolicy is vLLM's --scheduling-policy: "fcfs" (default)
	// refuses a request with a nonzero priority with vLLM's 400, "priority"
	// orders the waiting queue by (priority, arrival), lower first.
	SchedulingPolicy string
	// EngineID names this engine in kv_transfer_params.remote_engine_id;
	// empty means "sim-<role>-<random hex>".
	EngineID string
	// KVBlocks is the size of the KV block pool; default 4096.
	KVBlocks int
	// BlockSize is the number of tokens per KV block; default 16 (vLLM's).
	BlockSize int
	// PrefillTime is the fixed cost of a prefill; DefaultConfig sets 20ms.
	PrefillTime time.Duration
	// PrefillPerToken is added to PrefillTime per prompt token the prefill
	// computes, those the prefix cache holds excluded; default 0. A decode
	// with nothing to pull computes its prompt's uncached tokens at this cost.
	PrefillPerToken time.Duration
	// MaxNumBatchedTokens, when positive, shares the engine's compute as
	// vLLM's scheduler shares a step's token budget (--max-num-batched-tokens,
	// chunked prefill): prefills compute one after another in arrival order,
	// so that two at once take about twice as long as one, and each decode
	// step takes ITL plus PrefillPerToken for every running decode and, while
	// a prefill computes, for a chunk of this many of its tokens. Zero, the
	// default: every prefill and decode takes its own time however many run.
	MaxNumBatchedTokens int
	// ITL is the inter-token latency of a decoding request; DefaultConfig
	// sets 10ms. Zero means one token per request per scheduler step, as fast
	// as the loop turns.
	ITL time.Duration
	// MaxRunning caps the requests holding blocks and computing at once
	// (prefilling, pulling or decoding); the rest wait in a FIFO queue.
	// Default 256.
	MaxRunning int
	// KVHoldTimeout is the KV lease: how long a prefiller holds a finished
	// prefill's blocks for a decoder's read before freeing them itself, each
	// decoder heartbeat renewing it to now+KVHoldTimeout (vLLM's
	// kv_lease_duration, PR #41383). Zero means the default, 30s. Older vLLM
	// had a fixed 480s hold (VLLM_NIXL_ABORT_REQUEST_TIMEOUT) and no heartbeats.
	// With Protocol "mooncake" it is the fixed hold of a prefill no decoder
	// pulled (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT): zero means 480s, and so
	// does `proxy sim --protocol mooncake` without --kv-hold-timeout, but
	// DefaultConfig's 30s stays 30s.
	KVHoldTimeout time.Duration
	// KVHeartbeatInterval is how often a decoder renews the leases of the
	// do_remote_prefill requests it has queued or pulling, with one
	// POST /kv/heartbeat per prefiller. DefaultConfig sets 5s (vLLM derives
	// lease/6); zero disables heartbeats, as in vLLM before the lease.
	KVHeartbeatInterval time.Duration
	// MaxModelLen, when positive, rejects a prompt longer than this many
	// tokens with a 400, as vLLM's --max-model-len does in its serving layer
	// (a decoder then notifies the prefiller, vLLM #41269). Zero means no
	// limit beyond the pool's size; /v1/models reports the effective one.
	MaxModelLen int
	// NIXLHandshakeDelay is how long a decoder's first NIXL handshake with
	// a prefiller takes (seconds in vLLM, #46240): its first pull, and its
	// heartbeats, wait for it; later ones do not. It starts when a decode
	// for that prefiller is scheduled or first heartbeated. Default 0.
	NIXLHandshakeDelay time.Duration
	// KVTransferTime is the decoder's cost per pulled block; default 0. A
	// decoder pulls only the blocks its own prefix cache does not hold.
	KVTransferTime time.Duration
	// DisablePrefixCache turns the prefix cache off (flag --prefix-cache=false):
	// every prefill computes its whole prompt and nothing is cached.
	DisablePrefixCache bool
	// CPUOffloadBlocks, when positive, adds a CPU tier of that many blocks, as
	// vLLM's OffloadingConnector with a CPU backend (cputier.go): a block the
	// GPU pool evicts moves there, the tier dropping its least recently used
	// block when full, and a prompt's leading blocks found there (after those
	// on the GPU) are reloaded at CPUReloadPerBlock each instead of computed.
	// Zero, the default: no CPU tier. It needs the prefix cache.
	CPUOffloadBlocks int
	// SlidingWindow, when positive, makes the engine a hybrid model's: a second KV cache
	// group (group_idx 1) of sliding-window attention with a window of this many tokens,
	// beside the full-attention group (window.go). It caches each computed prompt's last
	// window blocks only, as vLLM with a KV connector does, so that a prefix is reused
	// only up to an end the window's blocks reach; its KV events are vLLM's for the group.
	// Zero, the default: full attention alone. It needs the prefix cache.
	SlidingWindow int
	// CPUReloadPerBlock is the time to reload one block from the CPU tier.
	// Default 0, as PrefillPerToken's: the sim's per-token costs are none
	// unless set, and a reload must not cost more than the recompute it
	// replaces. A realistic pair is about an eighth of a block's recompute:
	// a 16-token block of an 8B model (2 MiB of KV) crosses PCIe Gen4 in
	// about 80µs, where its prefill takes about 16 x 40µs.
	CPUReloadPerBlock time.Duration
	// KVEventsEndpoint, when set, publishes KV events in vLLM's format on a
	// ZMQ PUB socket (kvevents.go): bound when it holds a "*"
	// (tcp://*:5557), connected otherwise (tcp://host:port).
	KVEventsEndpoint string
	// KVEventsReplayEndpoint, when set, binds a ROUTER socket answering
	// replay requests (tcp://*:5558).
	KVEventsReplayEndpoint string
	// KVEventsTopic is the topic frame of every event message; empty, as
	// vLLM's default, matches every subscriber. llm-d's consumers expect
	// kv@<pod ip:port>@<model>.
	KVEventsTopic string
	// KVEventsFormat is how events are encoded: "array" (default; vLLM's
	// msgspec array_like, tag first) or "map" (vLLM PR #42892, a "type" key).
	KVEventsFormat string
	// DataParallelRank is the rank the event batches carry; rank r publishes
	// on the endpoints' ports + r, as vLLM's data parallel ranks do.
	DataParallelRank int
	// DataParallelSize is the number of data parallel ranks behind the one
	// server, each with its own scheduler, KV pool and engine id (rank 0's
	// is EngineID), chosen per request by the X-data-parallel-rank header
	// (absent: rank 0; out of range: a 400). Rank r's KV events carry rank
	// DataParallelRank+r, on the endpoints' ports + that. Zero means 1.
	DataParallelSize int
	// Seed feeds the deterministic token source (with the request id).
	Seed int64
	// Clock drives the scheduler, holds and fault delays; nil means the real clock.
	Clock Clock

	// FailStatus, when non-zero, answers every completion request with this
	// HTTP status and an OpenAI error body (header X-Sim-Fail-Status overrides).
	FailStatus int
	// Stall delays the first byte of every completion response; the engine
	// works meanwhile (header X-Sim-Stall overrides).
	Stall time.Duration
	// CloseAfter, when positive, closes the connection after that many SSE
	// events (streaming) or body bytes (non-streaming). 0 disables it here;
	// the header X-Sim-Close-After: 0 closes before any byte.
	CloseAfter int
	// DieAfter, when positive, kills the whole engine once a request has
	// sent that many tokens, as a crash would; only an engine a Server runs
	// can die (header X-Sim-Die-After overrides; 0 there dies before the
	// first token).
	DieAfter int
	// SlowWrite sleeps before every write of a completion response
	// (header X-Sim-Slow-Write overrides).
	SlowWrite time.Duration
	// TransferFail makes every KV transfer this engine takes part in fail:
	// the decoder answers 500 kv_transfer_failed, and an SGLang prefiller
	// frees the room and answers its leg 500 too (header X-Sim-Transfer-Fail
	// overrides, on either leg).
	TransferFail bool

	// SGLang and Mooncake (Protocol "sglang", "mooncake").

	// BootstrapPort is the port of an SGLang or Mooncake prefiller's
	// bootstrap server (SGLang's --disaggregation-bootstrap-port, vLLM's
	// mooncake bootstrap port), reported by GET /server_info as
	// disaggregation_bootstrap_port. DefaultConfig sets 8998, both engines'
	// default; zero picks a free port. Decoders ignore it.
	BootstrapPort int
	// BootstrapHost is the address the bootstrap server listens on; empty
	// means 127.0.0.1. `proxy sim` uses the host of --listen.
	BootstrapHost string
	// BootstrapTimeout, when positive, frees a room whose KV no decoder has
	// asked for within this long of the prefill's arrival, and fails the
	// prefill's leg with a 500 (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
	// Zero, the default: the room is held until it is aborted, as with NIXL.
	BootstrapTimeout time.Duration
	// WaitingTimeout is how long an SGLang decoder waits for its room's KV
	// before it fails the request with a 500 kv_transfer_timeout
	// (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), and how long a Mooncake
	// decoder waits for its transfer's prefill before it computes the
	// prompt itself. Zero means the default, 300s.
	WaitingTimeout time.Duration
	// DisconnectDelay is how long after a client disconnects an SGLang
	// engine aborts the request: SGLang notices a closed stream about 2s
	// later and a non-streaming request when it next polls. DefaultConfig
	// sets 2s; zero aborts at once. (vLLM aborts at once, whatever this is.)
	DisconnectDelay time.Duration
	// KVLoadFailurePolicy is what a Mooncake decoder does when the prefiller
	// cannot give its transfer's KV (unknown past WaitingTimeout, expired,
	// aborted, pulled already): "fail" (default, vLLM's
	// kv_load_failure_policy default) answers a 500 kv_transfer_failed,
	// "recompute" computes the prompt itself and answers 200.
	KVLoadFailurePolicy string
	// AdminAPIKey, when set, makes POST /abort_request answer 401 unless it
	// carries Authorization: Bearer <AdminAPIKey> (SGLang's --admin-api-key).
	AdminAPIKey string
	// Tokenizer is a Hugging Face tokenizer.json (a byte-level BPE, as
	// internal/hftok reads it) that prompts are tokenized with, a chat's
	// messages rendered through ChatML (tokenizer.go) as one text, as vLLM
	// tokenizes a rendered template. Empty means the sim's own tokenizer.
	Tokenizer string
}

// Defaults, in one place so that DefaultConfig, BindFlags and New agree.
const (
	defaultRole          = "both"
	defaultModel         = "sim"
	defaultKVBlocks      = 4096
	defaultBlockSize     = 16
	defaultPrefillTime   = 20 * time.Millisecond
	defaultITL           = 10 * time.Millisecond
	defaultMaxRunning    = 256
	defaultKVHoldTimeout = 30 * time.Second
	defaultKVHeartbeat   = 5 * time.Second
	defaultEmbeddingDim  = 16

	// SchedulingFCFS and SchedulingPriority are the values of Config.SchedulingPolicy.
	SchedulingFCFS     = "fcfs"
	SchedulingPriority = "priority"

	// ProtocolVLLM and ProtocolSGLang are the values of Config.Protocol.
	ProtocolVLLM     = "vllm"
	ProtocolSGLang   = "sglang"
	ProtocolMooncake = "mooncake"

	// defaultMooncakeHold is VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: a Mooncake
	// prefiller's hold of KV no decoder pulled.
	defaultMooncakeHold = 480 * time.Second

	// KVLoadFailureFail and KVLoadFailureRecompute are the values of
	// Config.KVLoadFailurePolicy.
	KVLoadFailureFail      = "fail"
	KVLoadFailureRecompute = "recompute"

	defaultBootstrapPort   = 8998 // SGLang's --disaggregation-bootstrap-port
	defaultWaitingTimeout  = 300 * time.Second
	defaultDisconnectDelay = 2 * time.Second
)

// DefaultConfig returns the documented defaults, the flags' defaults too.
func DefaultConfig() Config {
	return Config{
		Protocol:            ProtocolVLLM,
		Role:                defaultRole,
		Model:               defaultModel,
		KVBlocks:            defaultKVBlocks,
		BlockSize:           defaultBlockSize,
		PrefillTime:         defaultPrefillTime,
		ITL:                 defaultITL,
		MaxRunning:          defaultMaxRunning,
		KVHoldTimeout:       defaultKVHoldTimeout,
		KVHeartbeatInterval: defaultKVHeartbeat,
		BootstrapPort:       defaultBootstrapPort,
		WaitingTimeout:      defaultWaitingTimeout,
		DisconnectDelay:     defaultDisconnectDelay,
		KVEventsFormat:      KVEventsFormatArray,
		KVLoadFailurePolicy: KVLoadFailureFail,
		DataParallelSize:    1,
		EmbeddingDim:        defaultEmbeddingDim,
		SchedulingPolicy:    SchedulingFCFS,
	}
}

// BindFlags registers one flag per Config field on fs, with cfg's current
// values as defaults, so `proxy sim --help` documents them all.
func BindFlags(fs *flag.FlagSet, cfg *Config) {
	fs.StringVar(&cfg.Protocol, "protocol", cfg.Protocol, `prefill/decode protocol: "vllm" (kv_transfer_params, prefill then decode) or "sglang" (both legs at once, paired by a bootstrap room; needs --role prefill or decode)`)
	fs.StringVar(&cfg.Role, "role", cfg.Role, `engine role: "prefill", "decode" or "both" (vllm: informational, every role serves every request kind; sglang: the disaggregation mode)`)
	fs.StringVar(&cfg.Model, "model", cfg.Model, "served model names, comma-separated (vLLM's --served-model-name): the first is the default, a request naming another model gets a 404")
	fs.StringVar(&cfg.LoRAModules, "lora-modules", cfg.LoRAModules, "LoRA adapters served as models, name=path,name=path (vLLM's --lora-modules), listed by /v1/models with the first model as parent")
	fs.IntVar(&cfg.EmbeddingDim, "embedding-dim", cfg.EmbeddingDim, "size of the vectors /v1/embeddings and /pooling answer")
	fs.StringVar(&cfg.SchedulingPolicy, "scheduling-policy", cfg.SchedulingPolicy, `"fcfs" (a request with a nonzero priority is a 400, as vLLM's) or "priority" (waiting requests ordered by priority, lower first, then arrival)`)
	fs.StringVar(&cfg.EngineID, "engine-id", cfg.EngineID, "engine id sent as kv_transfer_params.remote_engine_id (empty: sim-<role>-<random>)")
	fs.IntVar(&cfg.KVBlocks, "kv-blocks", cfg.KVBlocks, "number of KV cache blocks in the pool")
	fs.IntVar(&cfg.BlockSize, "block-size", cfg.BlockSize, "tokens per KV block")
	fs.DurationVar(&cfg.PrefillTime, "prefill-time", cfg.PrefillTime, "fixed time a prefill takes")
	fs.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", cfg.PrefillPerToken, "extra prefill time per prompt token not in the prefix cache (a decode with nothing to pull computes its uncached tokens at this cost too)")
	fs.IntVar(&cfg.MaxNumBatchedTokens, "max-num-batched-tokens", cfg.MaxNumBatchedTokens, "share the engine's compute as vLLM's step budget does: prefills one after another, decode steps slower with more sequences and beside a prefill's chunk of this many tokens (0: every request computes on its own)")
	fs.DurationVar(&cfg.ITL, "itl", cfg.ITL, "inter-token latency while decoding (0: one token per scheduler step)")
	fs.IntVar(&cfg.MaxRunning, "max-running", cfg.MaxRunning, "requests computing at once; the rest wait in a FIFO queue")
	fs.DurationVar(&cfg.KVHoldTimeout, "kv-hold-timeout", cfg.KVHoldTimeout, "KV lease: how long a prefiller holds a finished prefill's KV blocks for a decoder's pull before freeing them; each decoder heartbeat renews it to now+lease (vLLM kv_lease_duration; older vLLM held a fixed 480s). --protocol mooncake: the fixed hold, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480s unless this flag is given")
	fs.DurationVar(&cfg.KVHeartbeatInterval, "kv-heartbeat-interval", cfg.KVHeartbeatInterval, "how often a decoder renews the KV lease of each do_remote_prefill request it has queued or pulling (POST /kv/heartbeat to the prefiller; 0: no heartbeats)")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", cfg.MaxModelLen, "reject prompts longer than this many tokens with a 400, as vLLM's --max-model-len (0: no limit but the pool's size)")
	fs.DurationVar(&cfg.NIXLHandshakeDelay, "nixl-handshake-delay", cfg.NIXLHandshakeDelay, "how long a decoder's first NIXL handshake with each prefiller takes: its first pull and heartbeats to it wait (0: none)")
	fs.DurationVar(&cfg.KVTransferTime, "kv-transfer-time", cfg.KVTransferTime, "decoder's pull cost per KV block it pulls (blocks in its own prefix cache are not pulled)")
	fs.Var(invertedBool{&cfg.DisablePrefixCache}, "prefix-cache", "prefix caching: reuse the cached leading full blocks of a prompt, keep freed blocks cached until evicted (LRU); --prefix-cache=false computes every prompt whole")
	fs.IntVar(&cfg.SlidingWindow, "sliding-window", cfg.SlidingWindow, "a hybrid model's sliding window, in tokens: a second KV cache group (group_idx 1) caches each prompt's last window blocks, and a prefix is reused only up to an end those reach (0: full attention alone)")
	fs.IntVar(&cfg.CPUOffloadBlocks, "cpu-offload-blocks", cfg.CPUOffloadBlocks, "blocks of a CPU KV tier (vLLM's OffloadingConnector): blocks evicted from the GPU pool move there (LRU, the oldest dropped when full) and a prompt's leading blocks found there are reloaded instead of computed; KV events carry medium CPU for them (0: no CPU tier)")
	fs.DurationVar(&cfg.CPUReloadPerBlock, "cpu-reload-per-block", cfg.CPUReloadPerBlock, "time to reload one block from the CPU tier, in place of its recompute (0, as --prefill-per-token's default: no cost; about 80µs for a 16-token block of an 8B model over PCIe Gen4)")
	fs.StringVar(&cfg.KVEventsEndpoint, "kv-events-endpoint", cfg.KVEventsEndpoint, "publish KV events (BlockStored, BlockRemoved, AllBlocksCleared) in vLLM's ZMQ format on this endpoint: bound when it holds *, e.g. tcp://*:5557, connected otherwise, e.g. tcp://127.0.0.1:5557 (empty: no events)")
	fs.StringVar(&cfg.KVEventsReplayEndpoint, "kv-events-replay-endpoint", cfg.KVEventsReplayEndpoint, "bind a ZMQ ROUTER here that replays buffered KV event batches from a start sequence number, e.g. tcp://*:5558 (empty: none)")
	fs.StringVar(&cfg.KVEventsTopic, "kv-events-topic", cfg.KVEventsTopic, "topic frame of the KV event messages (empty, vLLM's default, reaches every subscriber; llm-d expects kv@<ip:port>@<model>)")
	fs.StringVar(&cfg.KVEventsFormat, "kv-events-format", cfg.KVEventsFormat, "KV event encoding: array (vLLM's array_like structs, tag first) or map (a \"type\" key, vLLM PR #42892)")
	fs.IntVar(&cfg.DataParallelRank, "data-parallel-rank", cfg.DataParallelRank, "data parallel rank in the KV event batches; the KV event endpoints' ports are offset by it (with --data-parallel-size N, rank r publishes rank data-parallel-rank+r)")
	fs.IntVar(&cfg.DataParallelSize, "data-parallel-size", cfg.DataParallelSize, "data parallel ranks behind this server, each its own scheduler, KV pool and engine id, chosen per request by the X-data-parallel-rank header (absent: 0; out of range: 400); /debug/kv sums them and lists them under ranks")
	fs.Int64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the deterministic token source (tokens also depend on the request id)")
	fs.IntVar(&cfg.FailStatus, "fail-status", cfg.FailStatus, "fault: answer every completion request with this HTTP status (0: off; header X-Sim-Fail-Status)")
	fs.DurationVar(&cfg.Stall, "stall", cfg.Stall, "fault: delay the first byte of every completion response (header X-Sim-Stall)")
	fs.IntVar(&cfg.CloseAfter, "close-after", cfg.CloseAfter, "fault: close the connection after N SSE events or N body bytes (0: off; header X-Sim-Close-After)")
	fs.IntVar(&cfg.DieAfter, "die-after", cfg.DieAfter, "fault: the engine dies (every connection closed, the listener gone, proxy sim exits) once a request has sent N tokens (0: off; header X-Sim-Die-After)")
	fs.DurationVar(&cfg.SlowWrite, "slow-write", cfg.SlowWrite, "fault: sleep before every response write (header X-Sim-Slow-Write)")
	fs.BoolVar(&cfg.TransferFail, "transfer-fail", cfg.TransferFail, "fault: every KV transfer fails: the decoder answers 500, an sglang prefiller frees the room and answers 500 (header X-Sim-Transfer-Fail: true)")
	fs.IntVar(&cfg.BootstrapPort, "bootstrap-port", cfg.BootstrapPort, "sglang or mooncake prefiller: port of the bootstrap server, reported by GET /server_info (mooncake: GET /query lists each rank's engine id; 0: a free port)")
	fs.DurationVar(&cfg.BootstrapTimeout, "bootstrap-timeout", cfg.BootstrapTimeout, "sglang prefiller: free a room no decoder asked for within this long of the prefill's arrival and fail its leg with a 500 (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT; 0: hold it until aborted, as with NIXL)")
	fs.DurationVar(&cfg.WaitingTimeout, "waiting-timeout", cfg.WaitingTimeout, "sglang decoder: how long a request waits for its room's KV before failing with a 500 (SGLANG_DISAGGREGATION_WAITING_TIMEOUT); mooncake decoder: how long it waits for its transfer's prefill before computing the prompt itself")
	fs.DurationVar(&cfg.DisconnectDelay, "disconnect-delay", cfg.DisconnectDelay, "sglang: how long after its client disconnects a request is aborted (SGLang notices about 2s later; 0: at once)")
	fs.StringVar(&cfg.KVLoadFailurePolicy, "kv-load-failure-policy", cfg.KVLoadFailurePolicy, `mooncake decoder, when the prefiller cannot give the transfer's KV (unknown past --waiting-timeout, expired, aborted, pulled already): "fail" answers a 500 kv_transfer_failed (vLLM's default kv_load_failure_policy), "recompute" computes the prompt itself`)
	fs.StringVar(&cfg.Tokenizer, "tokenizer", cfg.Tokenizer, "a Hugging Face tokenizer.json (byte-level BPE) to tokenize prompts with, chat rendered as ChatML, in place of the sim's own tokenizer")
	fs.StringVar(&cfg.AdminAPIKey, "admin-api-key", cfg.AdminAPIKey, "when set, POST /abort_request needs Authorization: Bearer <key> (401 otherwise), as SGLang's --admin-api-key")
}

// withDefaults fills zero fields and rejects values that cannot work.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	if c.Protocol == "" {
		c.Protocol = d.Protocol
	}
	if c.Role == "" {
		c.Role = d.Role
	}
	if c.WaitingTimeout == 0 {
		c.WaitingTimeout = d.WaitingTimeout
	}
	if c.BootstrapHost == "" {
		c.BootstrapHost = "127.0.0.1"
	}
	if c.Model == "" {
		c.Model = d.Model
	}
	if c.KVBlocks == 0 {
		c.KVBlocks = d.KVBlocks
	}
	if c.EmbeddingDim == 0 {
		c.EmbeddingDim = d.EmbeddingDim
	}
	if c.SchedulingPolicy == "" {
		c.SchedulingPolicy = d.SchedulingPolicy
	}
	if c.BlockSize == 0 {
		c.BlockSize = d.BlockSize
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = d.MaxRunning
	}
	if c.KVHoldTimeout == 0 {
		c.KVHoldTimeout = d.KVHoldTimeout
		if c.Protocol == ProtocolMooncake {
			c.KVHoldTimeout = defaultMooncakeHold
		}
	}
	if c.KVLoadFailurePolicy == "" {
		c.KVLoadFailurePolicy = d.KVLoadFailurePolicy
	}
	if c.DataParallelSize == 0 {
		c.DataParallelSize = 1
	}
	if c.Clock == nil {
		c.Clock = realClock{}
	}
	if c.KVEventsFormat == "" {
		c.KVEventsFormat = d.KVEventsFormat
	}
	var errs []error
	if len(splitModels(c.Model)) == 0 {
		errs = append(errs, fmt.Errorf("model %q: names no model", c.Model))
	}
	if _, err := parseLoRAModules(c.LoRAModules); err != nil {
		errs = append(errs, err)
	}
	if c.EmbeddingDim < 0 || c.EmbeddingDim > maxEmbeddingDim {
		errs = append(errs, fmt.Errorf("embedding dim %d: want 1 to %d", c.EmbeddingDim, maxEmbeddingDim))
	}
	if c.SchedulingPolicy != SchedulingFCFS && c.SchedulingPolicy != SchedulingPriority {
		errs = append(errs, fmt.Errorf("scheduling policy %q: want fcfs or priority", c.SchedulingPolicy))
	}
	switch c.Role {
	case "prefill", "decode", "both":
	default:
		errs = append(errs, fmt.Errorf("role %q: want prefill, decode or both", c.Role))
	}
	switch c.Protocol {
	case ProtocolVLLM:
	case ProtocolSGLang, ProtocolMooncake:
		if c.Role == "both" {
			errs = append(errs, fmt.Errorf(`protocol %s: role "both" has no disaggregation mode; want prefill or decode`, c.Protocol))
		}
	default:
		errs = append(errs, fmt.Errorf("protocol %q: want vllm, sglang or mooncake", c.Protocol))
	}
	if c.BootstrapPort < 0 || c.BootstrapPort > 65535 {
		errs = append(errs, fmt.Errorf("bootstrap port %d: not a port", c.BootstrapPort))
	}
	if c.BootstrapTimeout < 0 || c.WaitingTimeout < 0 || c.DisconnectDelay < 0 {
		errs = append(errs, errors.New("bootstrap timeout, waiting timeout and disconnect delay must not be negative"))
	}
	if c.KVBlocks < 0 {
		errs = append(errs, fmt.Errorf("kv blocks %d: must be positive", c.KVBlocks))
	}
	if c.BlockSize < 0 {
		errs = append(errs, fmt.Errorf("block size %d: must be positive", c.BlockSize))
	}
	if c.MaxRunning < 0 {
		errs = append(errs, fmt.Errorf("max running %d: must be positive", c.MaxRunning))
	}
	if c.KVHoldTimeout < 0 {
		errs = append(errs, fmt.Errorf("kv hold timeout %s: must be positive", c.KVHoldTimeout))
	}
	if c.SlidingWindow < 0 || c.SlidingWindow > 0 && c.DisablePrefixCache {
		errs = append(errs, fmt.Errorf("sliding window %d: must not be negative, and needs the prefix cache", c.SlidingWindow))
	}
	if c.CPUOffloadBlocks < 0 || c.CPUReloadPerBlock < 0 {
		errs = append(errs, fmt.Errorf("cpu offload blocks %d, cpu reload per block %s: must not be negative", c.CPUOffloadBlocks, c.CPUReloadPerBlock))
	}
	if c.CPUOffloadBlocks > 0 && c.DisablePrefixCache {
		errs = append(errs, errors.New("cpu offload blocks: a CPU tier holds prefix-cached blocks, and the prefix cache is off (--prefix-cache=false)"))
	}
	if c.MaxModelLen < 0 {
		errs = append(errs, fmt.Errorf("max model len %d: must not be negative", c.MaxModelLen))
	}
	if c.KVHeartbeatInterval < 0 {
		errs = append(errs, fmt.Errorf("kv heartbeat interval %s: must not be negative", c.KVHeartbeatInterval))
	}
	if c.FailStatus != 0 && (c.FailStatus < 100 || c.FailStatus > 999) {
		errs = append(errs, fmt.Errorf("fail status %d: not an HTTP status", c.FailStatus))
	}
	if c.MaxNumBatchedTokens < 0 {
		errs = append(errs, fmt.Errorf("max num batched tokens %d: must not be negative", c.MaxNumBatchedTokens))
	}
	if c.PrefillTime < 0 || c.PrefillPerToken < 0 || c.ITL < 0 || c.KVTransferTime < 0 || c.NIXLHandshakeDelay < 0 {
		errs = append(errs, errors.New("prefill time, prefill per token, itl, kv transfer time and nixl handshake delay must not be negative"))
	}
	if c.CloseAfter < 0 || c.DieAfter < 0 || c.Stall < 0 || c.SlowWrite < 0 {
		errs = append(errs, errors.New("fault settings must not be negative"))
	}
	switch c.KVEventsFormat {
	case KVEventsFormatArray, KVEventsFormatMap:
	default:
		errs = append(errs, fmt.Errorf("kv events format %q: want array or map", c.KVEventsFormat))
	}
	if c.KVLoadFailurePolicy != KVLoadFailureFail && c.KVLoadFailurePolicy != KVLoadFailureRecompute {
		errs = append(errs, fmt.Errorf("kv load failure policy %q: want fail or recompute", c.KVLoadFailurePolicy))
	}
	if c.DataParallelSize < 0 || c.DataParallelSize > 64 {
		errs = append(errs, fmt.Errorf("data parallel size %d: want 1 to 64", c.DataParallelSize))
	}
	if c.DataParallelRank < 0 {
		errs = append(errs, fmt.Errorf("data parallel rank %d: must not be negative", c.DataParallelRank))
	}
	for _, ep := range []string{c.KVEventsEndpoint, c.KVEventsReplayEndpoint} {
		if err := checkEndpoint(ep); ep != "" && err != nil {
			errs = append(errs, err)
		}
	}
	if c.KVEventsReplayEndpoint != "" && c.KVEventsEndpoint == "" {
		errs = append(errs, errors.New("kv events replay endpoint needs a kv events endpoint"))
	}
	if len(errs) > 0 {
		return c, fmt.Errorf("sim config: %w", errors.Join(errs...))
	}
	return c, nil
}

// invertedBool is a boolean flag that sets the negation of its value, so
// that --prefix-cache=false sets Config.DisablePrefixCache, whose zero value
// keeps a Config built by hand caching.
type invertedBool struct{ p *bool }

func (b invertedBool) String() string {
	if b.p == nil {
		return "true"
	}
	return strconv.FormatBool(!*b.p)
}

func (b invertedBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return err
	}
	*b.p = !v
	return nil
}

func (b invertedBool) IsBoolFlag() bool { return true }

// checkEndpoint rejects a ZMQ endpoint that cannot be bound or dialled:
// tcp://host:port (host * binds every interface), ipc://path or inproc://name.
func checkEndpoint(ep string) error {
	scheme, addr, ok := strings.Cut(ep, "://")
	switch {
	case !ok || addr == "":
	case scheme == "ipc" || scheme == "inproc":
		return nil
	case scheme == "tcp":
		if _, port, err := net.SplitHostPort(addr); err == nil {
			if _, err := strconv.ParseUint(port, 10, 16); err == nil || port == "*" {
				return nil
			}
		}
	}
	return fmt.Errorf("kv events endpoint %q: want tcp://host:port, ipc://path or inproc://name", ep)
}

// loraModule is one --lora-modules entry.
type loraModule struct{ name, path string }

// splitModels is Config.Model's names, blanks dropped.
func splitModels(s string) []string {
	var out []string
	for _, m := range strings.Split(s, ",") {
		if m = strings.TrimSpace(m); m != "" {
			out = append(out, m)
		}
	}
	return out
}

// parseLoRAModules reads name=path,name=path (vLLM's --lora-modules, its
// name=path form).
func parseLoRAModules(s string) ([]loraModule, error) {
	var out []loraModule
	for _, kv := range strings.Split(s, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		name, path, ok := strings.Cut(kv, "=")
		name, path = strings.TrimSpace(name), strings.TrimSpace(path)
		if !ok || name == "" || path == "" {
			return nil, fmt.Errorf("lora module %q: want name=path", kv)
		}
		out = append(out, loraModule{name, path})
	}
	return out, nil
}

// maxEmbeddingDim bounds --embedding-dim and a request's dimensions.
const maxEmbeddingDim = 1 << 16

// Event formats, the values of Config.KVEventsFormat.
const (
	KVEventsFormatArray = "array"
	KVEventsFormatMap   = "map"
)
