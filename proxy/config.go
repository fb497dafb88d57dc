package proxy

// The proxy's section of the config: Config, the defaults of its keys, and its one check
// (Config.check), which fills them in and checks its own keys, then each subsection's
// (limits.go, priority.go, session.go; flow_control's here, CheckFlowControl, for it reads the
// other keys' headers), the sidecar slot's and the model aliases'.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Abort modes, release modes and pull modes: the values the config accepts (pdflow's).
const (
	AbortPrefillCancel         = pdflow.AbortPrefillCancel
	AbortPrefillFinishThenFree = pdflow.AbortPrefillFinishThenFree
	ReleaseDrain               = pdflow.ReleaseDrain
	ReleaseAbort               = pdflow.ReleaseAbort
	ReleaseWait                = pdflow.ReleaseWait
	PullAbortImmediate         = pdflow.PullAbortImmediate
	PullAbortAfterFirstToken   = pdflow.PullAbortAfterFirstToken
	ReserveBeforePrefill       = pdflow.ReserveBeforePrefill
	ReserveAfterPrefill        = pdflow.ReserveAfterPrefill
	PrefillUnavailableDecode   = pdflow.PrefillUnavailableDecode
	PrefillUnavailableFail     = pdflow.PrefillUnavailableFail
)

// The defaults of the proxy's keys, each stated here once: a zero value in Config means the
// default the key's comment names.
const (
	DefaultMaxBodyBytes       = 10 << 20
	DefaultReadBodyTimeout    = 30 * time.Second
	DefaultMaxConnections     = 10000
	DefaultPhaseTimeout       = pdflow.DefaultPhaseTimeout
	DefaultClientWriteTimeout = 60 * time.Second
	DefaultPrefillRetries     = 1
	DefaultDecodeRetries      = 1
	DefaultMigrationMaxTokens = 65536
)

// Config tunes the HTTP front and the P/D flow. Zero values mean the defaults in brackets:
// named constants (DefaultMaxBodyBytes...), or a value where the default is no constant's.
type Config struct {
	// MaxBodyBytes bounds a request body; larger gets 413, at once when the request
	// announces its length. [DefaultMaxBodyBytes]
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// ReadBodyTimeout bounds how long a client may take to send its request body, counted
	// from the end of its headers: a body that stalls is answered 408 in the OpenAI shape
	// and its connection (on HTTP/2, its stream) closed, so that it cannot hold a goroutine
	// and a connection for as long as it likes. [DefaultReadBodyTimeout]
	ReadBodyTimeout time.Duration `yaml:"read_body_timeout"`
	// MaxConnections bounds the client connections the proxy's listener holds at once: one
	// more is closed as soon as it is accepted (a reset), and counted in
	// pdproxy_connections_refused_total. [DefaultMaxConnections]; negative means no bound.
	MaxConnections int `yaml:"max_connections"`
	// AbortDuringPrefill: cancel (close the prefill connection at once) or finish_then_release
	// (let the prefill finish, then release its KV: for engines with no explicit abort). [cancel]
	AbortDuringPrefill string `yaml:"abort_during_prefill"`
	// KVRelease is how held KV is released when the client leaves before the decode was sent:
	// drain (a one-token decode that pulls it), abort (the engine's explicit abort where it
	// has one, else drain) or wait (leave it to the engine's timer). [drain]
	KVRelease string `yaml:"kv_release"`
	// AbortDuringKVPull: immediate, or after_first_token (defer a decode's cancel until its
	// first byte, for engines that crash on an abort during the KV pull, race R3). [immediate]
	AbortDuringKVPull string `yaml:"abort_during_kv_pull"`
	// DecoderReservation: before_prefill (a decoder slot is taken before the prefill starts, so
	// KV is never held while waiting for one) or after_prefill (the prefiller never waits
	// for a decoder, but a prefilled request may wait in kv_held). [before_prefill]
	DecoderReservation string `yaml:"decoder_reservation"`
	// PDUncachedTokenThreshold turns on conditional disaggregation: a request whose reserved
	// decoder already holds all but fewer than this many of its prompt's tokens (as the
	// decoder's KV events tell; precise_cache_aware's index) is served decode-only, counted in
	// pdproxy_decode_only_total{reason="cached"}. It needs decoder_reservation before_prefill
	// (refused otherwise) and a decoder whose KV events the proxy reads (cmd/proxy refuses a
	// config that reads none). [0: always disaggregate]
	PDUncachedTokenThreshold int `yaml:"pd_uncached_token_threshold"`
	// MigrationLimit is how many times a stream whose decoder fails after its first byte may
	// go on on another decoder, token-exact (migration.go, docs/engines.md). [0: never]
	MigrationLimit int `yaml:"migration_limit"`
	// MigrationMaxTokens bounds the token ids a stream keeps to go on elsewhere, its prompt's
	// and its answer's: a longer one is not migrated. [DefaultMigrationMaxTokens]
	MigrationMaxTokens int `yaml:"migration_max_tokens"`
	// PrefillTimeout bounds the prefill call. [DefaultPhaseTimeout]
	PrefillTimeout time.Duration `yaml:"prefill_timeout"`
	// DecodeFirstByteTimeout bounds the wait for a decode's first byte. [DefaultPhaseTimeout]
	DecodeFirstByteTimeout time.Duration `yaml:"decode_first_byte_timeout"`
	// DecodeIdleTimeout bounds the silence between two chunks of a decode. [DefaultPhaseTimeout]
	DecodeIdleTimeout time.Duration `yaml:"decode_idle_timeout"`
	// DrainTimeout bounds a drain-only decode (it runs after the client left, on its own
	// deadline). A drain cut while its decoder may be pulling the blocks is an abort during
	// the transfer, which engines handle worst (race R3), so by default it lasts as long as
	// the prefiller may hold them. [the prefiller's kv_hold_timeout: its lease]
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// ClientWriteTimeout bounds one write to the client: a client that stops reading its
	// stream is given up on after it, and everything it held is released. [DefaultClientWriteTimeout]
	ClientWriteTimeout time.Duration `yaml:"client_write_timeout"`
	// PrefillRetries is how many other prefillers a prefill that provably never started is
	// tried on. [DefaultPrefillRetries]; negative means none.
	PrefillRetries int `yaml:"prefill_retries"`
	// DecodeRetries is how many other decoders a decode whose connection could not be made
	// is tried on (only then did the decoder provably never start it). [DefaultDecodeRetries];
	// negative: none.
	DecodeRetries int `yaml:"decode_retries"`
	// DecodeOnlyFallback sends a request straight to a decoder when its prefill failed on
	// every prefiller it was tried on (or none could take it: busy, queue full). [true]
	DecodeOnlyFallback *bool `yaml:"decode_only_fallback"`
	// PrefillUnavailable is what a request does when the pool has no usable prefiller at all
	// (every one down, ejected or removed, or none serves its model): decode_only sends it
	// straight to a decoder, which computes the prompt itself; fail answers 503. Decoders of
	// paired engines (SGLang, Mooncake) cannot serve alone: their requests fail either way.
	// [decode_only when decode_only_fallback is on, else fail]
	PrefillUnavailable string `yaml:"prefill_unavailable"`
	// APIKeysFile is a file of client API keys, one a line; blank lines and # comments are
	// skipped. When it or APIKeysEnv is set, every route but AuthOpenPaths answers 401
	// unless the request carries "Authorization: Bearer <key>" with one of the keys, and
	// the client's Authorization is not passed on to backends. A file with no key is an
	// error. Empty means no file.
	APIKeysFile string `yaml:"api_keys_file"`
	// APIKeysEnv names an environment variable holding comma-separated client API keys,
	// added to those of APIKeysFile. An unset or empty variable is an error. Empty means
	// none.
	APIKeysEnv string `yaml:"api_keys_env"`
	// AuthOpenPaths are the exact paths served without a key when keys are configured.
	// [/health, /ready, /metrics]; an explicit empty list opens none.
	AuthOpenPaths []string `yaml:"auth_open_paths"`
	// PrefillerHeader turns on llm-d's sidecar slot: each request's prefiller is the
	// host:port this header names (llm-d's scheduler sends x-prefiller-host-port), if
	// PrefillerAllow covers it (else 403), and the decode goes to the config's one decode
	// backend; a request without it is decoded there alone. The header is never forwarded.
	// Empty, the default, means the mode is off and the header is ignored.
	PrefillerHeader string `yaml:"prefiller_header"`
	// PrefillerAllow lists the prefillers the header may name, required with PrefillerHeader:
	// CIDRs (any port), IP:port, or host:port patterns where a * matches within one DNS
	// label ("vllm-prefill-*.ns.svc:8000") and a port of * any port.
	PrefillerAllow []string `yaml:"prefiller_allow"`
	// ModelAliases map a model name clients use to the served model it stands for
	// ("chat: llama-3-70b"), or to several split by weight ("canary: [{model: v1, weight:
	// 90}, {model: v2, weight: 10}]"). The body's model is rewritten before it is sent and
	// the client's name put back in the answer; /v1/models lists every alias. An alias
	// shadows a served model of the same name, and may not name another alias. Empty means
	// none.
	ModelAliases map[string]Alias `yaml:"model_aliases"`
	// Limits are each client's limits (limits.go): concurrency and rate per API key, and
	// per tenant behind one. [none]
	Limits LimitsConfig `yaml:"limits"`
	// Priority maps requests to priority classes that order the wait queue when every
	// engine is full (priority.go). [none: first come, first served]
	Priority PriorityConfig `yaml:"priority"`
	// SessionAffinity sends a session's requests to one decoder and one prefiller, on every
	// replica (session.go). [off]
	SessionAffinity SessionAffinityConfig `yaml:"session_affinity"`
	// FlowControl shares the engines among tenants by weight while requests wait for them
	// (flowcontrol.go). [off]
	FlowControl FlowControlConfig `yaml:"flow_control"`
}

// Validate checks cfg as New would: every key of the proxy's section, its defaults filled in
// on a copy.
func (c Config) Validate() error {
	_, err := c.check()
	return err
}

// WithDefaults is cfg with its defaults filled in, as New runs with it; the error is
// Validate's.
func (c Config) WithDefaults() (Config, error) {
	_, err := c.check()
	return c, err
}

// check fills in c's defaults and checks every key of the proxy's section, in one place: its
// own keys, then each subsection's (limits, priority, session_affinity, flow_control), the
// sidecar slot's and the model aliases. It answers the sidecar slot's allowlist. The checks
// against other sections (CheckEngines, CheckFlowControl's queue) need the router's config,
// and are made where both are known.
func (c *Config) check() (allowlist, error) {
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ReadBodyTimeout <= 0 {
		c.ReadBodyTimeout = DefaultReadBodyTimeout
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = DefaultMaxConnections
	}
	if c.AbortDuringPrefill == "" {
		c.AbortDuringPrefill = AbortPrefillCancel
	}
	if c.KVRelease == "" {
		c.KVRelease = ReleaseDrain
	}
	if c.AbortDuringKVPull == "" {
		c.AbortDuringKVPull = PullAbortImmediate
	}
	for _, d := range []*time.Duration{&c.PrefillTimeout, &c.DecodeFirstByteTimeout, &c.DecodeIdleTimeout} {
		if *d <= 0 {
			*d = DefaultPhaseTimeout
		}
	}
	if c.ClientWriteTimeout <= 0 {
		c.ClientWriteTimeout = DefaultClientWriteTimeout
	}
	if c.PrefillRetries == 0 {
		c.PrefillRetries = DefaultPrefillRetries
	}
	if c.PrefillRetries < 0 {
		c.PrefillRetries = 0
	}
	if c.DecodeRetries == 0 {
		c.DecodeRetries = DefaultDecodeRetries
	}
	if c.DecodeRetries < 0 {
		c.DecodeRetries = 0
	}
	if c.DecodeOnlyFallback == nil {
		on := true
		c.DecodeOnlyFallback = &on
	}
	if c.DecoderReservation == "" {
		c.DecoderReservation = ReserveBeforePrefill
	}
	switch c.PrefillUnavailable {
	case "":
		c.PrefillUnavailable = PrefillUnavailableFail
		if *c.DecodeOnlyFallback {
			c.PrefillUnavailable = PrefillUnavailableDecode
		}
	case PrefillUnavailableDecode, PrefillUnavailableFail:
	default:
		return allowlist{}, fmt.Errorf("prefill_unavailable: %q is not one of decode_only, fail", c.PrefillUnavailable)
	}
	if c.MigrationLimit < 0 {
		return allowlist{}, fmt.Errorf("migration_limit: %d is negative", c.MigrationLimit)
	}
	if c.MigrationMaxTokens < 0 {
		return allowlist{}, fmt.Errorf("migration_max_tokens: %d is negative", c.MigrationMaxTokens)
	}
	if c.MigrationMaxTokens == 0 {
		c.MigrationMaxTokens = DefaultMigrationMaxTokens
	}
	if err := c.Limits.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := c.Priority.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := c.SessionAffinity.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := CheckFlowControl(c, nil); err != nil {
		return allowlist{}, err
	}
	switch c.DecoderReservation {
	case ReserveBeforePrefill, ReserveAfterPrefill:
	default:
		return allowlist{}, fmt.Errorf("decoder_reservation: %q is not one of before_prefill, after_prefill", c.DecoderReservation)
	}
	if c.PDUncachedTokenThreshold > 0 && c.DecoderReservation == ReserveAfterPrefill {
		// Whose cache would be weighed is known only once a decoder is reserved.
		return allowlist{}, fmt.Errorf("pd_uncached_token_threshold: needs decoder_reservation before_prefill, so that the decoder is known before its prefill is skipped")
	}
	switch c.AbortDuringPrefill {
	case AbortPrefillCancel, AbortPrefillFinishThenFree:
	default:
		return allowlist{}, fmt.Errorf("abort_during_prefill: %q is not one of cancel, finish_then_release", c.AbortDuringPrefill)
	}
	switch c.KVRelease {
	case ReleaseDrain, ReleaseAbort, ReleaseWait:
	default:
		return allowlist{}, fmt.Errorf("kv_release: %q is not one of drain, abort, wait", c.KVRelease)
	}
	switch c.AbortDuringKVPull {
	case PullAbortImmediate, PullAbortAfterFirstToken:
	default:
		return allowlist{}, fmt.Errorf("abort_during_kv_pull: %q is not one of immediate, after_first_token", c.AbortDuringKVPull)
	}
	allow, err := c.validateSidecar()
	if err != nil {
		return allowlist{}, err
	}
	return allow, validateAliases(c.ModelAliases)
}

// validateSidecar checks prefiller_header and prefiller_allow, and returns the allowlist.
func (c *Config) validateSidecar() (allowlist, error) {
	if c.PrefillerHeader == "" {
		if len(c.PrefillerAllow) > 0 {
			return allowlist{}, fmt.Errorf("prefiller_allow: set without prefiller_header, so nothing reads it; set prefiller_header: x-prefiller-host-port for llm-d's sidecar slot, or remove it")
		}
		return allowlist{}, nil
	}
	if !httpguts.ValidHeaderFieldName(c.PrefillerHeader) {
		return allowlist{}, fmt.Errorf("prefiller_header: %q is not a header name", c.PrefillerHeader)
	}
	if len(c.PrefillerAllow) == 0 {
		return allowlist{}, fmt.Errorf("prefiller_allow: required with prefiller_header: without it any client could make the proxy call any host:port; list the prefillers' CIDRs or host:port patterns")
	}
	return parseAllowlist(c.PrefillerAllow)
}

// CheckFlowControl checks cfg's flow_control, filling its defaults, against the router's
// queue (nil: checked as far as it goes without it). It refuses what could not take effect:
// a queue that lets nothing wait, a per-tenant bound above the queue's size, a tenant header
// another setting reads, a key digest that no configured key has.
func CheckFlowControl(cfg *Config, queue *routerconfig.QueueConfig) error {
	c := &cfg.FlowControl
	if !c.on() {
		return nil
	}
	switch {
	case c.DefaultWeight < 0:
		return fmt.Errorf("flow_control.default_weight: %d is negative", c.DefaultWeight)
	case c.DefaultWeight == 0:
		c.DefaultWeight = 1
	}
	if c.QueueTimeout < 0 {
		return fmt.Errorf("flow_control.queue_timeout: %v is negative", c.QueueTimeout)
	}
	if c.ReservedSlots == 0 {
		c.ReservedSlots = DefaultReservedSlots
	}
	if c.SaturationTTFT < 0 {
		return fmt.Errorf("flow_control.saturation_ttft: %v is negative", c.SaturationTTFT)
	}
	if c.MaxQueuePerTenant < 0 {
		return fmt.Errorf("flow_control.max_queue_per_tenant: %d is negative", c.MaxQueuePerTenant)
	}
	if h := http.CanonicalHeaderKey(c.TenantHeader); h != "" {
		for _, other := range []struct{ key, header string }{
			{"priority.header", cfg.Priority.Header}, {"prefiller_header", cfg.PrefillerHeader},
		} {
			if h == http.CanonicalHeaderKey(other.header) {
				return fmt.Errorf("flow_control.tenant_header: %s is %s too; one header cannot name both", c.TenantHeader, other.key)
			}
		}
		for _, s := range cfg.SessionAffinity.Headers {
			if h == http.CanonicalHeaderKey(s) {
				return fmt.Errorf("flow_control.tenant_header: %s is a session_affinity header too; one header cannot name both", c.TenantHeader)
			}
		}
	}
	digests := map[string]string{}
	c.Tenants = maps.Clone(c.Tenants) // the defaults go into a map of this config's own
	for _, name := range slices.Sorted(maps.Keys(c.Tenants)) {
		t := c.Tenants[name]
		f := "flow_control.tenants." + name
		switch {
		case !className.MatchString(name) || slices.Contains(reservedTenants, name):
			return fmt.Errorf("%s: %q is not 1 to 32 of a-z, 0-9, _ and -, or is a reserved name (%s)", f, name, strings.Join(reservedTenants, ", "))
		case t.Weight < 0:
			return fmt.Errorf("%s.weight: %d is negative", f, t.Weight)
		case t.Weight == 0:
			t.Weight = c.DefaultWeight
		}
		if len(t.APIKeySHA256) == 0 && c.TenantHeader == "" {
			return fmt.Errorf("%s: names no api_key_sha256 and there is no tenant_header: no request could be of it", f)
		}
		t.APIKeySHA256 = slices.Clone(t.APIKeySHA256)
		for i, d := range t.APIKeySHA256 {
			d = strings.ToLower(strings.TrimSpace(d))
			if b, err := hex.DecodeString(d); err != nil || len(b) != sha256.Size {
				return fmt.Errorf("%s.api_key_sha256[%d]: not a SHA-256 digest in hex (64 digits)", f, i)
			}
			if other, dup := digests[d]; dup {
				return fmt.Errorf("%s.api_key_sha256[%d]: the key is %s's too", f, i, other)
			}
			digests[d] = name
			t.APIKeySHA256[i] = d
		}
		c.Tenants[name] = t
	}
	if queue == nil {
		return nil
	}
	size := queue.Size
	if size == 0 {
		size = routerconfig.DefaultQueueSize
	}
	switch {
	case size < 0:
		return fmt.Errorf("flow_control: set, but queue.size is %d: no request waits, so there is no queue to share; set queue.size", queue.Size)
	case c.MaxQueuePerTenant > size:
		return fmt.Errorf("flow_control.max_queue_per_tenant: %d is above queue.size (%d), which bounds every tenant first; lower it or raise queue.size", c.MaxQueuePerTenant, size)
	}
	return nil
}
