// Package app wires pdproxy together: flags, the config file, the simulated engines of the
// embedded default, the router, the lifecycle table and the HTTP front, with Start and
// Shutdown. cmd/proxy is a thin main around it; the end-to-end tests start the very same Main
// on port 0.
package app

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/configs"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// The defaults of Config's own keys, filled in by setDefaults.
const (
	DefaultListen            = "127.0.0.1:8000"
	DefaultLogFormat         = "console"
	DefaultLogLevel          = "info"
	DefaultShutdownTimeout   = 10 * time.Second
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultSimListen is a simulated engine's address: a free loopback port.
	DefaultSimListen = "127.0.0.1:0"
)

// Config is the whole configuration, as read from YAML. Zero values mean the defaults in
// brackets; the proxy and router sections are inlined at the top level.
type Config struct {
	// Listen is the proxy's address. [DefaultListen]
	Listen string `yaml:"listen"`
	// TLSCertFile and TLSKeyFile are a PEM certificate (chain) and its private key: with
	// both set, the listener serves HTTPS only (TLS 1.2 or newer, HTTP/2 by ALPN). Empty
	// means plain HTTP; setting one without the other is an error. Read at startup.
	TLSCertFile string `yaml:"tls_cert_file"`
	TLSKeyFile  string `yaml:"tls_key_file"`
	// AdminListen is the address of a separate admin listener serving the Go profiler
	// (/debug/pprof/). Empty, the default, means none: profiles expose internals and cost
	// CPU, so they are never on the proxy's own listener and only where asked for.
	AdminListen string `yaml:"admin_listen"`
	// LogFormat is json or console. [DefaultLogFormat]
	LogFormat string `yaml:"log_format"`
	// LogLevel is debug, info, warn or error. [DefaultLogLevel]
	LogLevel string `yaml:"log_level"`
	// KVHoldTimeout bounds how long the proxy forwards a prefiller's kv_transfer_params after
	// the prefill. It keeps a margin below every prefiller's own hold (vLLM's lease), which
	// starts before the proxy reads the answer and which a decoder's heartbeats extend only
	// once the decoder has the request: at most 2/3 of the shortest, or the proxy refuses to
	// start. [2/3 of the shortest prefiller's kv_hold_timeout: 20s for vLLM's 30s lease]
	KVHoldTimeout time.Duration `yaml:"kv_hold_timeout"`
	// ShutdownTimeout is the drain deadline: on SIGTERM, streams in flight may finish for this
	// long, then the rest are aborted (their KV released). [DefaultShutdownTimeout]
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"`
	// ReadHeaderTimeout bounds how long a client may take to send its request headers: one
	// that trickles them is disconnected after it, so it cannot hold a connection open.
	// [DefaultReadHeaderTimeout]
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout"`
	// Proxy is the HTTP front and P/D flow.
	Proxy proxy.Config `yaml:",inline"`
	// Router is the backend pools.
	Router routerconfig.Config `yaml:",inline"`
	// SharedState is the Redis where the replicas share the per_key limits; none by default:
	// each replica works alone.
	SharedState sharedstate.Config `yaml:"shared_state"`
	// Tracing sends the requests' traces to an OTLP collector; off by default.
	Tracing TracingConfig `yaml:"tracing"`
	// Sims are simulated engines started in-process on loopback and added to the pools: the
	// embedded default runs one prefiller and one decoder.
	Sims []SimConfig `yaml:"sims"`
	// Source is how the command line made this config, so that a reload on SIGHUP reads the
	// file again and applies the same flags on top. Never read from YAML.
	Source Source `yaml:"-"`
}

// Source is the command line's part of a Config. Its zero value means the embedded default
// with no flags.
type Source struct {
	// File is the --config file; empty means flags only or the embedded default, which a
	// reload has nothing to read again from.
	File string
	// Prefill and Decode are the --prefill and --decode URLs, added to the file's backends.
	Prefill, Decode []string
	// Engine is --engine, the engine kind of the --prefill and --decode URLs; empty means
	// vllm.
	Engine string
	// Listen, AdminListen and LogFormat are --listen, --admin-listen and --log-format;
	// empty means what the file says.
	Listen, AdminListen, LogFormat string
	// TLSCert and TLSKey are --tls-cert and --tls-key; empty means what the file says.
	TLSCert, TLSKey string
}

func (s Source) engine() string {
	if s.Engine == "" {
		return engine.KindVLLM
	}
	return s.Engine
}

// load makes the Config this command line stands for: the file (or, with no file and no
// URL flags, the embedded default) with the flags applied on top.
func (s Source) load() (Config, error) {
	var c Config
	switch {
	case s.File != "":
		data, err := os.ReadFile(s.File)
		if err != nil {
			return Config{}, fmt.Errorf("read config: %w", err)
		}
		if c, err = ParseConfig(data); err != nil {
			return Config{}, fmt.Errorf("%s: %w", s.File, err)
		}
	case len(s.Prefill)+len(s.Decode) == 0:
		c = DefaultConfig()
	}
	return s.apply(c)
}

// apply puts the flags on top of a config read from the file.
func (s Source) apply(c Config) (Config, error) {
	for _, u := range s.Prefill {
		c.Router.Backends = append(c.Router.Backends, routerconfig.BackendConfig{URL: u, Role: routerconfig.RolePrefill, Engine: s.engine()})
	}
	for _, u := range s.Decode {
		c.Router.Backends = append(c.Router.Backends, routerconfig.BackendConfig{URL: u, Role: routerconfig.RoleDecode, Engine: s.engine()})
	}
	if s.Listen != "" {
		c.Listen = s.Listen
	}
	if s.AdminListen != "" {
		c.AdminListen = s.AdminListen
	}
	if s.LogFormat != "" {
		c.LogFormat = s.LogFormat
	}
	if s.TLSCert != "" {
		c.TLSCertFile = s.TLSCert
	}
	if s.TLSKey != "" {
		c.TLSKeyFile = s.TLSKey
	}
	// Refused here as well as at Start, so that a bad command line stops the proxy before
	// its logger is built.
	if err := c.checkCommandLine(); err != nil {
		return Config{}, err
	}
	c.Source = s
	return c, nil
}

// checkCommandLine checks the keys the flags may set.
func (c *Config) checkCommandLine() error {
	if (c.TLSCertFile == "") != (c.TLSKeyFile == "") {
		return errors.New("tls_cert_file and tls_key_file (--tls-cert, --tls-key): set both to serve HTTPS, or neither")
	}
	switch c.LogFormat {
	case "", "json", "console":
	default:
		return fmt.Errorf("log_format (--log-format): %q is not json or console", c.LogFormat)
	}
	return nil
}

// check is the config's validation, before anything starts: the app's own keys here, and
// each section by the check of the package that owns it (proxy.Config.Validate,
// TracingConfig.validate, sharedstate.Config.Validate in checkSharedState). The router's
// section is checked by router.New (routerconfig.Config.Validate), once the simulated engines
// listen and their backends can be added, and what spans the proxy's and the router's
// sections by checkConditional, as a reload does. Start calls it first.
func (c *Config) check() error {
	if err := c.checkCommandLine(); err != nil {
		return err
	}
	for i, sc := range c.Sims {
		if sc.Role != "prefill" && sc.Role != "decode" {
			return fmt.Errorf("sims[%d].role: %q is not prefill or decode", i, sc.Role)
		}
		if sc.Listen != "" {
			if _, _, err := net.SplitHostPort(sc.Listen); err != nil {
				return fmt.Errorf("sims[%d].listen: %w", i, err)
			}
		}
	}
	if err := c.Tracing.validate(); err != nil {
		return err
	}
	if err := c.Proxy.Validate(); err != nil {
		return err
	}
	return checkSharedState(*c)
}

// SimConfig is one in-process simulated engine (see `proxy sim --help` for each field).
type SimConfig struct {
	Role            string        `yaml:"role"`
	Model           string        `yaml:"model"`
	Listen          string        `yaml:"listen"` // [DefaultSimListen]
	KVBlocks        int           `yaml:"kv_blocks"`
	BlockSize       int           `yaml:"block_size"`
	PrefillTime     time.Duration `yaml:"prefill_time"`
	PrefillPerToken time.Duration `yaml:"prefill_per_token"`
	ITL             time.Duration `yaml:"itl"`
	MaxRunning      int           `yaml:"max_running"`
	// MaxNumBatchedTokens shares the engine's compute as vLLM's step budget does (the sim's
	// --max-num-batched-tokens). [0: every request computes on its own]
	MaxNumBatchedTokens int           `yaml:"max_num_batched_tokens"`
	KVHoldTimeout       time.Duration `yaml:"kv_hold_timeout"`
	KVTransferTime      time.Duration `yaml:"kv_transfer_time"`
	Seed                int64         `yaml:"seed"`
	// Tokenizer is a tokenizer.json the engine tokenizes with (the sim's --tokenizer).
	// [the sim's own tokenizer]
	Tokenizer string `yaml:"tokenizer"`
	// MaxInflight is the proxy's in-flight limit for this engine (the router's max_inflight).
	MaxInflight int `yaml:"max_inflight"`
	// Engine is the kind the proxy takes the engine for. [sim] "vllm" makes the proxy treat
	// it as vLLM, with no explicit abort, which is how tests show what happens on vLLM.
	Engine string `yaml:"engine"`
	// Stall, FailStatus, CloseAfter, SlowWrite and TransferFail are the engine's fault
	// defaults.
	Stall        time.Duration `yaml:"stall"`
	FailStatus   int           `yaml:"fail_status"`
	CloseAfter   int           `yaml:"close_after"`
	SlowWrite    time.Duration `yaml:"slow_write"`
	TransferFail bool          `yaml:"transfer_fail"`
	// Protocol is the engine's prefill/decode protocol: [vllm] or "sglang" (bootstrap
	// rooms; role prefill or decode). An sglang sim is taken for an SGLang engine unless
	// Engine says otherwise; its bootstrap server listens on a free port of its listen host.
	Protocol string `yaml:"protocol"`
	// BootstrapTimeout, WaitingTimeout, DisconnectDelay and AdminAPIKey are an sglang
	// sim's; the proxy's backend for it gets the admin key. [sim.DefaultConfig's; a
	// negative disconnect_delay means 0]
	BootstrapTimeout time.Duration `yaml:"bootstrap_timeout"`
	WaitingTimeout   time.Duration `yaml:"waiting_timeout"`
	DisconnectDelay  time.Duration `yaml:"disconnect_delay"`
	AdminAPIKey      string        `yaml:"admin_api_key"`
	// SchedulingPolicy (fcfs or priority: the body's priority orders the queue, as vLLM's
	// --scheduling-policy), LoRAModules ("name=path,...": adapters listed as models) and
	// EmbeddingDim (the size of /v1/embeddings vectors) are the sim's flags of those names.
	SchedulingPolicy string `yaml:"scheduling_policy"`
	LoRAModules      string `yaml:"lora_modules"`
	EmbeddingDim     int    `yaml:"embedding_dim"`
}

// ParseConfig reads a YAML config. Unknown keys are rejected, with their line.
func ParseConfig(data []byte) (Config, error) {
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) {
		return Config{}, fmt.Errorf("config: %w", err)
	}
	return c, nil
}

// DefaultConfig is the embedded default: a simulated prefiller and decoder on loopback.
func DefaultConfig() Config {
	c, err := ParseConfig(configs.Default)
	if err != nil {
		// The embedded file is part of the binary and covered by tests.
		panic(err)
	}
	return c
}

func (c *Config) setDefaults() {
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if c.LogFormat == "" {
		c.LogFormat = DefaultLogFormat
	}
	if c.LogLevel == "" {
		c.LogLevel = DefaultLogLevel
	}
	if c.ShutdownTimeout <= 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.ReadHeaderTimeout <= 0 {
		c.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
}

// urlList is a repeatable flag.
type urlList []string

func (u *urlList) String() string     { return strings.Join(*u, ",") }
func (u *urlList) Set(v string) error { *u = append(*u, v); return nil }

// LoadConfig turns the command line into a Config: --prefill/--decode URLs (repeatable) name
// vLLM engines; --config reads a file; with neither, the embedded default starts simulated
// engines. --listen, --admin-listen and --log-format override what the file says.
func LoadConfig(args []string, stderr io.Writer) (Config, error) {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		src               Source
		prefills, decodes urlList
	)
	fs.Var(&prefills, "prefill", "URL of a prefill engine (repeatable)")
	fs.Var(&decodes, "decode", "URL of a decode engine (repeatable); with none of --prefill/--decode/--config, simulated engines start in-process")
	fs.StringVar(&src.Engine, "engine", "", "engine kind of the --prefill and --decode URLs: "+strings.Join(engine.Kinds(), ", ")+" (default vllm)")
	fs.StringVar(&src.File, "config", "", "YAML config file (see configs/); unknown keys are rejected; SIGHUP reloads its backends")
	fs.StringVar(&src.Listen, "listen", "", "address to serve on (default "+DefaultListen+")")
	fs.StringVar(&src.AdminListen, "admin-listen", "", "address of a separate admin listener serving the Go profiler, /debug/pprof/ (default none)")
	fs.StringVar(&src.LogFormat, "log-format", "", "log format: json or console (default "+DefaultLogFormat+")")
	fs.StringVar(&src.TLSCert, "tls-cert", "", "PEM certificate file: serve HTTPS (with --tls-key)")
	fs.StringVar(&src.TLSKey, "tls-key", "", "PEM private key file of --tls-cert")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: proxy [flags]\n       proxy sim [flags]   (run one simulated engine; proxy sim --help)\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected argument %q (flags go before nothing else; see --help)", fs.Arg(0))
	}
	src.Prefill, src.Decode = prefills, decodes
	return src.load()
}

// EngineCatalog gives the router engine's engine kinds, as the opaque values it hands back
// on every backend (routerconfig.Config.Engines).
type EngineCatalog struct{}

// Engine returns engine's engine of kind.
func (EngineCatalog) Engine(kind string) (routerconfig.Engine, bool) {
	e, ok := engine.Lookup(kind)
	return e, ok
}

// Kinds lists engine's engine kinds.
func (EngineCatalog) Kinds() []string { return engine.Kinds() }

// checkPrefillUnavailable refuses prefill_unavailable: decode_only, said in so many words,
// when every decoder is of a paired engine (SGLang, Mooncake): such a decoder waits for a
// prefiller's room and never serves alone, so the choice could never take effect.
func checkPrefillUnavailable(p proxy.Config, r routerconfig.Config) error {
	if p.PrefillUnavailable != proxy.PrefillUnavailableDecode {
		return nil
	}
	var kinds []string
	for _, b := range r.Backends {
		if b.Role != routerconfig.RoleDecode {
			continue
		}
		e, ok := engine.Lookup(b.Engine)
		if _, paired := e.(engine.Paired); !ok || !paired {
			return nil
		}
		kinds = append(kinds, b.Engine)
	}
	if len(kinds) == 0 {
		return nil
	}
	return fmt.Errorf("prefill_unavailable: decode_only cannot take effect: every decoder is of a paired engine (%s), which cannot serve a request without its prefiller; set prefill_unavailable: fail",
		strings.Join(slices.Compact(slices.Sorted(slices.Values(kinds))), ", "))
}

// checkConditional refuses the proxy's keys that the backends would never let take effect:
// the sequential flow's keys when every engine is paired (proxy.CheckEngines), and
// pd_uncached_token_threshold when no decoder's KV events are read: the proxy knows what a
// decoder holds only from its events, and without them conditional disaggregation would be
// accepted and never fire. The router's part of the config says which engines there are and
// where events come from (kv_events.listen, which any engine may dial, or a decode
// backend's own endpoint or port); the proxy's part holds the keys, so both are checked
// here.
func checkConditional(p proxy.Config, r routerconfig.Config) error {
	if err := checkPrefillUnavailable(p, r); err != nil {
		return err
	}
	kinds := make([]string, len(r.Backends))
	for i, b := range r.Backends {
		kinds[i] = b.Engine
	}
	if err := proxy.CheckEngines(p, kinds); err != nil {
		return err
	}
	if err := proxy.CheckFlowControl(&p, &r.Queue); err != nil {
		return err
	}
	if p.PDUncachedTokenThreshold <= 0 || r.KVEvents.Listen != "" {
		return nil
	}
	for _, b := range r.Backends {
		if b.Role == routerconfig.RoleDecode && (b.KVEventsEndpoint != "" || b.KVEventsPort > 0) {
			return nil
		}
	}
	return fmt.Errorf("pd_uncached_token_threshold: %d needs the decoders' KV events, and none are read: set kv_events_endpoint or kv_events_port on the decode backends, or kv_events.listen for them to publish to; without them no decoder's cache is known and every request is disaggregated",
		p.PDUncachedTokenThreshold)
}

// checkSharedState refuses a shared_state that cannot take effect: one that does not
// validate, or one that nothing would use. The replicas share the per_key limits, the
// sessions' bindings and, for a pool on a cache-aware policy, where the heads of prompts went, so a
// shared_state with none of them would be accepted and never asked.
func checkSharedState(c Config) error {
	if err := c.SharedState.Validate(); err != nil {
		return err
	}
	if !c.SharedState.Enabled() {
		return nil
	}
	placements := false
	for _, name := range []string{c.Router.PrefillPolicy, c.Router.DecodePolicy} {
		caps, _ := routerconfig.CapsOf(name)
		placements = placements || caps.SharesPlacements
	}
	if l := c.Proxy.Limits.PerKey; l.RequestsPerSecond == 0 && l.MaxConcurrent == 0 && len(c.Proxy.SessionAffinity.Headers) == 0 && !placements {
		return errors.New("shared_state: nothing would use it: the replicas share the limits of limits.per_key (requests_per_second, max_concurrent), the bindings of session_affinity and, for a pool on cache_aware or precise_cache_aware, where the heads of prompts went, and none is set")
	}
	return nil
}
