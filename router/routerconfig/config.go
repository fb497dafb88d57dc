package routerconfig

import (
	"fmt"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/kvcache"
)

// Role is what a backend does in disaggregated serving.
type Role string

const (
	// RolePrefill backends compute the prompt's KV cache and hold it for a decoder.
	RolePrefill Role = "prefill"
	// RoleDecode backends generate tokens; an aggregated (non-P/D) engine is a decoder.
	RoleDecode Role = "decode"
)

// maxDataParallelSize bounds data_parallel_size: vLLM's largest deployments run far fewer.
const maxDataParallelSize = 1024

// Defaults applied by Config.Validate to zero fields.
const (
	// DefaultPolicy is prefill_policy's and decode_policy's.
	DefaultPolicy              = PolicyLeastInflight
	DefaultWeight              = 1
	DefaultMaxInflight         = 256
	DefaultPrefixTokens        = 256
	DefaultBoundedLoadFactor   = 1.25
	DefaultHealthInterval      = 5 * time.Second
	DefaultHealthTimeout       = 2 * time.Second
	DefaultUnhealthyThreshold  = 2
	DefaultHealthyThreshold    = 1
	DefaultHealthPath          = "/health"
	DefaultConsecutiveFailures = 3
	DefaultBaseBackoff         = 5 * time.Second  // with active checks off; with them on, one interval
	DefaultMaxBackoff          = 30 * time.Second // or base_backoff, if that is longer
	DefaultQueueSize           = 1024
	DefaultQueueTimeout        = 10 * time.Second
	// DefaultPrefillTokensPerSecond and DefaultPrefillOverhead are an engine's prefill model
	// before the proxy learns it; DefaultDecodeCostTokens what a decoding request weighs.
	DefaultPrefillTokensPerSecond = 10000
	DefaultPrefillOverhead        = 10 * time.Millisecond
	DefaultDecodeCostTokens       = 16
	// DefaultTreeTTL is how long routed text counts as cached in the approximate view.
	DefaultTreeTTL             = 2 * time.Minute
	DefaultBalanceAbsThreshold = 64
	DefaultBalanceRelThreshold = 1.5
	DefaultBlockSize           = kvcache.DefaultBlockSize
	DefaultKVEventsStaleAfter  = 60 * time.Second
	DefaultTokenizeTimeout     = time.Second
	DefaultTokenizeMaxTokens   = 128 << 10
)

// AutoScrapeInterval is how often each of engines engines' /metrics is scraped, where a pool's
// policy weighs load and scrape_interval is left out: every 100ms, so that replicas that learn
// of each other's requests only from the engines' reports place on a picture at most that old,
// or every millisecond per engine where that is longer, so that a replica reads at most 1,000
// reports a second whatever its pools (1s at 1,000 engines).
func AutoScrapeInterval(engines int) time.Duration {
	return max(100*time.Millisecond, time.Duration(engines)*time.Millisecond)
}

// minScrapeInterval keeps a typo ("1ms") from turning the proxy into a load generator
// against the engines' metrics endpoints.
const minScrapeInterval = 10 * time.Millisecond

// TokenizerEngine is the one value of Config.Tokenizer: requests are tokenized by an
// engine's POST /tokenize.
const TokenizerEngine = "engine"

// BackendConfig is one engine from config.
type BackendConfig struct {
	// Name labels the backend in metrics, logs and router.Hint.Exclude. Empty means the URL's
	// host:port, with the role in front ("decode-host:port") when unnamed backends of both
	// roles share the address (one engine in both roles). Names are unique across the config.
	Name string `yaml:"name"`
	// URL is the engine's base URL, http(s)://host:port, required. With Discover, its host
	// is a DNS name that names a pool of engines on its port.
	URL string `yaml:"url"`
	// Discover "dns" makes the entry a pool: every A and AAAA record of the URL's host is one
	// backend (a Kubernetes headless Service's pods), named "<name>/<address>:<port>", with
	// every other key of the entry; the name is resolved again every Refresh, a new address
	// is added and one gone is drained as a backend removed by a reload. A lookup that fails
	// keeps the last good set; a name with no record empties the pool. Empty means the URL
	// is one engine.
	Discover string `yaml:"discover"`
	// Refresh is how often a discover entry's name is resolved again. Zero means
	// DefaultRefresh; it may only be set with Discover.
	Refresh time.Duration `yaml:"refresh"`
	// Role is prefill or decode, required.
	Role Role `yaml:"role"`
	// Weight biases round_robin, prefix_affinity (virtual nodes), placement (the router's rendezvous order)
	// and least_inflight ties.
	// Zero means DefaultWeight.
	Weight int `yaml:"weight"`
	// MaxInflight is how many requests the router sends at once before queueing. Zero
	// means DefaultMaxInflight.
	MaxInflight int `yaml:"max_inflight"`
	// DataParallelSize is how many data-parallel ranks the engine serves behind its one
	// API server (vLLM's --data-parallel-size): each lease then takes the rank with the
	// fewest of the backend's requests in flight, which the proxy names in the
	// X-data-parallel-rank header of the calls that need it. 0 or 1 means one rank, and no
	// header.
	DataParallelSize int `yaml:"data_parallel_size"`
	// Engine is the engine kind, one of Config.Engines' kinds; empty means its default
	// (vllm, with cmd/proxy's catalog).
	Engine string `yaml:"engine"`
	// KVHoldTimeout is the engine's own KV hold timeout. Zero means the engine kind's
	// default.
	KVHoldTimeout time.Duration `yaml:"kv_hold_timeout"`
	// APIKey is the engine's own key (vLLM's --api-key), sent as "Authorization: Bearer"
	// on every call to it, health checks included; it replaces whatever key the client
	// sent. Empty means none is sent.
	APIKey string `yaml:"api_key"`
	// APIKeyEnv names an environment variable that holds APIKey, so the key stays out of
	// the file. It is read when the config is applied; naming an unset or empty variable
	// is an error. Set at most one of APIKey and APIKeyEnv.
	APIKeyEnv string `yaml:"api_key_env"`
	// TLSCAFile is a PEM bundle of the CAs the engine's certificate must chain to, for an
	// https URL. It replaces the system roots for this backend, and is re-read on every
	// config apply. Empty means the system roots.
	TLSCAFile string `yaml:"tls_ca_file"`
	// TLSServerName is the name the engine's certificate must carry (and the SNI sent),
	// when it differs from the URL's host, e.g. a URL by IP address. Empty means the host
	// (with Discover, the DNS name: certificates name the Service, not the pod).
	TLSServerName string `yaml:"tls_server_name"`
	// BootstrapPort is the port of an SGLang prefiller's bootstrap server. Zero means the
	// one the engine reports (GET /server_info). Other engines ignore it.
	BootstrapPort int `yaml:"bootstrap_port"`
	// Models are the model names the engine serves (its served names and LoRA adapters),
	// which requests naming another model never reach. Empty means what the engine's GET
	// /v1/models lists, asked after each health check that passes; until it first answers,
	// the backend may take a request for any model.
	Models []string `yaml:"models"`
	// AdminAPIKey is the engine's admin key (SGLang's --admin-api-key), sent on its admin
	// calls (the explicit abort) in place of api_key. AdminAPIKeyEnv names a variable that
	// holds it instead. Empty means api_key, if any.
	AdminAPIKey    string `yaml:"admin_api_key"`
	AdminAPIKeyEnv string `yaml:"admin_api_key_env"`
	// TLSInsecureSkipVerify accepts any certificate from the engine: the link is encrypted
	// but anyone on the path can pose as the engine and read every prompt. For tests only;
	// it is logged as a warning whenever the backend's client is built. [false]
	TLSInsecureSkipVerify bool `yaml:"tls_insecure_skip_verify"`
	// KVEventsEndpoint is the engine's KV events publisher to dial, "tcp://host:5557": the
	// endpoint of vLLM's --kv-events-config (which binds "tcp://*:5557" by default), with
	// the engine's address. Empty means the engine dials kv_events.listen, or publishes
	// nothing the proxy reads.
	KVEventsEndpoint string `yaml:"kv_events_endpoint"`
	// KVEventsReplayEndpoint is the engine's replay endpoint, "tcp://host:5558" (vLLM's
	// replay_endpoint), asked for the events missed after a gap in the sequence. Empty means
	// none: after a gap the engine's blocks are forgotten until its next events.
	KVEventsReplayEndpoint string `yaml:"kv_events_replay_endpoint"`
	// KVEventsPort and KVEventsReplayPort are the same endpoints by port, on the engine's
	// own address (tcp://<engine host>:<port>): what a discover entry takes, since each
	// engine it finds publishes on its own address, and what lets every proxy replica
	// dial every engine and so see all its events. Zero means none; an endpoint given
	// above wins.
	KVEventsPort       int `yaml:"kv_events_port"`
	KVEventsReplayPort int `yaml:"kv_events_replay_port"`
	// KVEventsDiscover asks the engine where its KV event publishers are bound (vLLM's
	// GET /kv_event_sources, PR #55844: one per data parallel rank, with its replay
	// endpoint) after every health check that passes, and dials each: for engines whose
	// --kv-events-config binds port 0 ("tcp://*:0"), each rank taking a free port only the
	// engine knows. A source on a wildcard host is dialed on the engine's own address. Once
	// the engine answers, its sources are dialed in place of the endpoints above. [false]
	KVEventsDiscover bool `yaml:"kv_events_discover"`
}

// HealthConfig configures active health checks.
type HealthConfig struct {
	// Interval between checks of every backend. Zero means DefaultHealthInterval; negative
	// disables active checks (in YAML, "interval: 0" also disables them, because an explicit
	// zero is a choice, while a missing key is not).
	Interval time.Duration `yaml:"interval"`
	// Timeout of one check. Zero means DefaultHealthTimeout.
	Timeout time.Duration `yaml:"timeout"`
	// UnhealthyThreshold consecutive failed checks mark a backend down. Zero means
	// DefaultUnhealthyThreshold. A check (or a request) refused at connect marks it down at
	// once, whatever this says: nothing listens at its address.
	UnhealthyThreshold int `yaml:"unhealthy_threshold"`
	// HealthyThreshold consecutive passed checks mark a down backend up. Zero means
	// DefaultHealthyThreshold.
	HealthyThreshold int `yaml:"healthy_threshold"`
	// Path is requested with GET on the backend's URL; a 2xx passes. Empty means
	// DefaultHealthPath.
	Path string `yaml:"path"`
}

// UnmarshalYAML reads the health section. It exists because an explicit "interval: 0"
// must disable checks while a missing interval means the default, and time.Duration
// alone cannot tell the two apart (yaml.v3 also refuses a bare 0 for a duration).
func (h *HealthConfig) UnmarshalYAML(n *yaml.Node) error {
	type plain HealthConfig
	var interval *yaml.Node
	rest := *n
	if n.Kind == yaml.MappingNode {
		rest.Content = nil
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == "interval" {
				interval = n.Content[i+1]
				continue
			}
			rest.Content = append(rest.Content, n.Content[i], n.Content[i+1])
		}
	}
	var p plain
	if err := rest.Decode(&p); err != nil {
		return err
	}
	if interval != nil {
		d, err := time.ParseDuration(interval.Value)
		if err != nil {
			return fmt.Errorf("health.interval: %w", err)
		}
		if d <= 0 {
			d = -1 // disabled
		}
		p.Interval = d
	}
	*h = HealthConfig(p)
	return nil
}

// EjectionConfig configures passive ejection: a backend that fails requests in a row is
// taken out of rotation for a backoff that doubles on each ejection, then takes one request
// at a time (probation) until one succeeds.
type EjectionConfig struct {
	// ConsecutiveFailures transport errors or 5xx answers in a row eject a backend. Zero
	// means 3; negative disables passive ejection. A connection refused (or with no route)
	// is not counted here: it marks the backend down at once (see HealthConfig), or, with
	// active checks off, ejects it at once, even with passive ejection disabled.
	ConsecutiveFailures int `yaml:"consecutive_failures"`
	// BaseBackoff is the first ejection's length. Zero means one health.interval, or
	// DefaultBaseBackoff with active checks off. It may not be shorter than health.interval: a
	// backend back from ejection would take requests again before any check could look at it.
	BaseBackoff time.Duration `yaml:"base_backoff"`
	// MaxBackoff caps the doubling. Zero means DefaultMaxBackoff, or base_backoff if that is
	// longer.
	MaxBackoff time.Duration `yaml:"max_backoff"`
}

// QueueConfig configures the wait for a free slot when every eligible backend is full.
type QueueConfig struct {
	// Size is how many requests per role may wait. Zero means DefaultQueueSize; negative
	// disables waiting (a full pool answers ErrQueueFull at once).
	Size int `yaml:"size"`
	// Timeout is the longest wait before ErrQueueTimeout. Zero means DefaultQueueTimeout.
	Timeout time.Duration `yaml:"timeout"`
	// TTFTBound, when positive, counts a pool placed by cost as saturated while even its best
	// candidate's predicted time to first token is over it with work ahead there: a request
	// then waits in the queue as it would for a slot under max_inflight, and the pool's
	// saturation reads its predicted TTFT against it. It is flow_control.saturation_ttft, set
	// by the proxy's flow control; zero means slots alone saturate a pool.
	TTFTBound time.Duration `yaml:"-"`
	// ReservedSlots is how many free slots of a pool a tenant that already has a request in
	// flight may not take while another tenant, active within the last second, has none in
	// flight and none waiting: what lets a quiet tenant's request start at once while another
	// floods. It is flow_control.reserved_slots, set by the proxy's flow control; zero keeps
	// none.
	ReservedSlots int `yaml:"-"`
}

// CacheAwareConfig tunes cache_aware and precise_cache_aware.
type CacheAwareConfig struct {
	// CacheThreshold is refused when set: a request goes where its prefill costs least
	// (the router's cost model), whatever share of it an engine holds, so no share gates it. It is kept
	// only so that a config carrying it is told why it cannot take effect.
	CacheThreshold float64 `yaml:"cache_threshold"`
	// PrefillTokensPerSecond is an engine's prefill rate before the proxy has learned it
	// from the engine's own prefills: the uncached prompt tokens it computes a second. Zero
	// means DefaultPrefillTokensPerSecond.
	PrefillTokensPerSecond float64 `yaml:"prefill_tokens_per_second"`
	// PrefillOverhead is the fixed part of a prefill's time, whatever its tokens (a step,
	// the calls). Zero means DefaultPrefillOverhead.
	PrefillOverhead time.Duration `yaml:"prefill_overhead"`
	// DecodeCostTokens is what one request decoding on an engine adds to a new request's
	// wait there, in prefill tokens (a decode takes a token of every step's budget). Zero
	// means DefaultDecodeCostTokens; negative is refused.
	DecodeCostTokens int `yaml:"decode_cost_tokens"`
	// Temperature, when positive, draws the pick among the candidates with weights
	// exp(-(cost - lowest cost) / temperature) instead of taking the lowest, so that replicas
	// reading the same engines do not all herd onto one between two scrapes. Zero, the
	// default, takes the lowest, near-equal costs broken alike on every replica.
	Temperature time.Duration `yaml:"temperature"`
	// TreeTTL is how long text routed to an engine counts as cached there in the approximate
	// view: an engine evicts what its prefix cache has not used for a while, and a tree that
	// never forgot would keep sending conversations to contexts that are gone. Zero means
	// DefaultTreeTTL.
	TreeTTL time.Duration `yaml:"tree_ttl"`
	// BalanceAbsThreshold and BalanceRelThreshold are an upper guard on the cost: when the
	// pool is out of balance (its most loaded candidate has more than abs requests, its
	// load as the router weighs it, above the least loaded, and more than rel times as
	// many), requests go to the least loaded whatever the costs say. Zero means DefaultBalanceAbsThreshold and
	// DefaultBalanceRelThreshold; a negative abs means any difference counts; rel may not be
	// below 1.
	BalanceAbsThreshold int     `yaml:"balance_abs_threshold"`
	BalanceRelThreshold float64 `yaml:"balance_rel_threshold"`
	// MaxTreeBytes bounds the approximate view of each pool (the text routed to each
	// engine, plus a fixed cost per node); the least recently routed texts go first. Zero
	// means kvcache.DefaultMaxTreeBytes.
	MaxTreeBytes int `yaml:"max_tree_bytes"`
}

// OutOfBalance reports whether a pool whose least and most loaded candidates have lo and hi
// in flight is out of balance: hi more than BalanceAbsThreshold above lo and more than
// BalanceRelThreshold times it.
func (c CacheAwareConfig) OutOfBalance(lo, hi int64) bool {
	return hi-lo > int64(c.BalanceAbsThreshold) && float64(hi) > c.BalanceRelThreshold*float64(lo)
}

// KVEventsConfig configures how the proxy reads the engines' KV events, for
// precise_cache_aware.
type KVEventsConfig struct {
	// Listen is a ZMQ endpoint where the proxy binds a SUB socket that engines dial,
	// "tcp://10.0.0.2:5557": each engine publishes with the topic "kv@<host:port>@<model>",
	// where host:port is its backend URL's, from that host's address (or AllowedSources). An
	// empty host binds loopback, "*" every address. Empty means none; engines are then dialed
	// at their kv_events_endpoint. Read at start: a reload may not change it.
	Listen string `yaml:"listen"`
	// StaleAfter is how long after an engine's last event its blocks still count: an engine
	// silent for longer is scored by cache_aware's view (the text routed to it), which also
	// covers an engine that stopped publishing. Zero means DefaultKVEventsStaleAfter.
	StaleAfter time.Duration `yaml:"stale_after"`
	// ReplayTimeout bounds one replay after a gap. Zero means kvcache.DefaultReplayTimeout.
	ReplayTimeout time.Duration `yaml:"replay_timeout"`
	// MaxBlocksPerBackend bounds the blocks the index keeps of each engine: events past it are
	// dropped and counted (index_full). Zero means kvcache.DefaultMaxBlocks, far above a
	// GPU's. Read at start.
	MaxBlocksPerBackend int `yaml:"max_blocks_per_backend"`
	// MaxBlocks bounds the blocks the index keeps in all, a block counted once per engine
	// holding it: stores past it are dropped and counted (index_full) until the engines'
	// removals make room. About 45 bytes each; zero means kvcache.DefaultMaxTotalBlocks
	// (about 3 GiB). Read at start.
	MaxBlocks int `yaml:"max_blocks"`
	// AllowedSources are IP addresses and CIDR prefixes, "10.0.0.0/24", whose messages on
	// kv_events.listen may speak for any backend: engines behind a NAT or a relay. Without
	// them a topic's events are taken only from its backend's host address. Empty means none.
	AllowedSources []string `yaml:"allowed_sources"`
	// TierWeights weighs a block by the medium its engine holds it on (the medium of its KV
	// events): gpu, cpu, disk (the media DISK, LocalDisk, SSD, NVMe), or a medium's own name
	// for a tier of its own (at most 5; a medium no weight names counts as not held), matched
	// without regard to case. A weight is the share of a block's recompute that holding it
	// there saves, in [0, 1]: gpu's is the unit, 1 and only 1; a CPU block costs a reload.
	// Absent tiers take 1, kvcache.DefaultCPUWeight and kvcache.DefaultDiskWeight. The weights
	// may change on a reload, the names of the tiers of their own not.
	TierWeights map[string]float64 `yaml:"tier_weights"`
}

// Config is the router's part of the proxy config.
type Config struct {
	// Backends lists the engines; at least one decode backend is required.
	Backends []BackendConfig `yaml:"backends"`
	// PrefillPolicy selects among prefill backends; empty means DefaultPolicy.
	PrefillPolicy string `yaml:"prefill_policy"`
	// DecodePolicy selects among decode backends; empty means DefaultPolicy.
	DecodePolicy string `yaml:"decode_policy"`
	// PrefixTokens is how much of router.Hint.Prefix prefix_affinity hashes, in tokens, where
	// a token is taken as 4 bytes (a common average for English text with BPE tokenizers), so the
	// first 4*PrefixTokens bytes are hashed. The router has no tokenizer, and what matters is
	// only that equal prompt heads land on the same backend. It is also the head a prompt no
	// engine caches is placed by: the first 4*PrefixTokens bytes of router.Hint.Text,
	// or PrefixTokens of router.Hint.Tokens without text. Zero means DefaultPrefixTokens.
	PrefixTokens int `yaml:"prefix_tokens"`
	// BoundedLoadFactor is c of consistent hashing with bounded loads (Mirrokni et al.): a
	// prompt no engine caches, or a session, goes to the first engine in the rendezvous order
	// of its key whose load, with the request, is at most ceil(c × (total load + 1) / n)
	// (weighted: × weight / mean weight); prefix_affinity walks its ring past a backend above
	// c × (average + 1). The lower, the sooner a hot key spreads; 1 is perfectly even. Zero
	// means DefaultBoundedLoadFactor; below 1 is refused, as no engine could then be within
	// its bound.
	BoundedLoadFactor float64 `yaml:"bounded_load_factor"`
	// Health configures active health checks.
	Health HealthConfig `yaml:"health"`
	// Ejection configures passive ejection.
	Ejection EjectionConfig `yaml:"ejection"`
	// Queue configures backpressure.
	Queue QueueConfig `yaml:"queue"`
	// ScrapeInterval is how often least_loaded, cache_aware and precise_cache_aware read each
	// engine's /metrics (and how long one read may take), the load they weigh; three intervals
	// without a good read and they weigh the engine by in-flight requests. Zero means
	// AutoScrapeInterval of the engines scraped; else at least 10ms. Unused by the other
	// policies.
	ScrapeInterval time.Duration `yaml:"scrape_interval"`
	// Engines resolves each backend's engine kind. Nil takes any kind as a bare name, with
	// no default kind and no default kv_hold_timeout.
	Engines EngineCatalog `yaml:"-"`
	// Resolver looks up the names of discover entries. Nil means net.DefaultResolver.
	Resolver Resolver `yaml:"-"`
	// EngineClient is the HTTP client the proxy calls engines with: EngineClientLean, its
	// own HTTP/1.1 client, or EngineClientStdlib, net/http's transport. Empty means
	// DefaultEngineClient.
	EngineClient string `yaml:"engine_client"`
	// CacheAware tunes cache_aware and precise_cache_aware.
	CacheAware CacheAwareConfig `yaml:"cache_aware"`
	// KVEvents configures the KV event subscribers of precise_cache_aware.
	KVEvents KVEventsConfig `yaml:"kv_events"`
	// Tokenizer is how precise_cache_aware gets a request's tokens: "engine", an engine's
	// POST /tokenize (router.Router.Tokens). Empty means engine when a pool uses
	// precise_cache_aware.
	Tokenizer string `yaml:"tokenizer"`
	// Tokenizers are the models whose requests the proxy tokenizes itself, by model name
	// (as the engines serve it), each from its Hugging Face files; the other models' are
	// tokenized by an engine's /tokenize. Read at start: a reload may not change them.
	Tokenizers map[string]TokenizerFiles `yaml:"tokenizers"`
	// LocalTokenizers are Tokenizers' tokenizers, by model: cmd/proxy reads the files.
	// A model's is used once an engine agreed with it on its samples (router.Router.CheckTokenizers).
	// Read at New.
	LocalTokenizers map[string]LocalTokenizer `yaml:"-"`
	// TokenizeTimeout bounds one /tokenize call; a request whose tokens do not come in time
	// is scored by its text. Zero means DefaultTokenizeTimeout.
	TokenizeTimeout time.Duration `yaml:"tokenize_timeout"`
	// TokenizeMaxTokens bounds the tokens the proxy's own tokenizer (Tokenizers) gives one
	// request: a prompt that has more is scored by its text, tokenized no further than
	// that. No engine takes a prompt longer than its max_model_len, so the engines' largest
	// max_model_len is all routing can use of one. Zero means DefaultTokenizeMaxTokens.
	TokenizeMaxTokens int `yaml:"tokenize_max_tokens"`
	// EngineTokenizer is how tokenizer: engine tokenizes, at the backend router.Router.Tokens picks
	// (cmd/proxy passes engine's: the engine's POST /tokenize). Nil means router.Router.Tokens
	// answers ErrNoTokenizer, and precise_cache_aware scores requests by their text. Read at
	// New: a reload keeps the one the router was built with.
	EngineTokenizer Tokenizer `yaml:"-"`
	// SharedPlacements says the replicas share where the heads of prompts went (the proxy's
	// shared_state; router.Router.Heads): cache_aware then spreads the prompts no engine
	// holds by what this replica sent each engine lately, the shared placements keeping every
	// replica's later requests of a prompt where the first went. Without it cache_aware places
	// them by the rendezvous order of their head alone, which every replica computes alike
	// without a word. cmd/proxy sets it from shared_state, which a reload may not change.
	SharedPlacements bool `yaml:"-"`
	// BlockSize is the engines' KV block size in tokens (vLLM's --block-size), for events that
	// do not give theirs; an event's own block_size wins. Zero means DefaultBlockSize. Read at
	// start.
	BlockSize int `yaml:"block_size"`
}

// TokenizerFiles are a model's tokenizer files.
type TokenizerFiles struct {
	// File is the model's tokenizer.json (a byte-level BPE), required.
	File string `yaml:"file"`
	// ChatTemplate is the model's chat template: its tokenizer_config.json (whose
	// chat_template, bos_token and eos_token are read) or a Jinja file. Empty means chat
	// requests are tokenized by an engine's /tokenize.
	ChatTemplate string `yaml:"chat_template"`
}

// The engine clients of Config.EngineClient.
const (
	EngineClientLean   = "lean"
	EngineClientStdlib = "stdlib"
	// DefaultEngineClient is the engine client of an empty engine_client.
	DefaultEngineClient = EngineClientLean
)
