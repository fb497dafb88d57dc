package router

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/pdproxy/pdproxy/internal/h1client"
	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Backend is one engine. Its exported fields come from config and are read-only; the
// live state (in-flight count, health, ejection) sits behind atomics so the hot path
// reads it without locks.
type Backend struct {
	// Name labels the backend in metrics, logs and Hint.Exclude.
	Name string
	// URL is the engine's parsed base URL; callers must not modify it.
	URL *url.URL
	// URLString is the engine's base URL as configured.
	URLString string
	// Role is prefill or decode.
	Role routerconfig.Role
	// Engine is the backend's engine, from routerconfig.Config.Engines: opaque to the router.
	Engine routerconfig.Engine
	// KVHoldTimeout is the engine's own KV hold timeout.
	KVHoldTimeout time.Duration
	// Weight biases selection; at least 1.
	Weight int
	// MaxInflight is the in-flight limit above which requests queue; at least 1.
	MaxInflight int

	// BootstrapPort is the configured bootstrap port (SGLang); zero means ask the engine.
	BootstrapPort int

	// models are the configured models; nil means the engine's list (backendState.models).
	models []string

	// kvEvents and kvReplay are the engine's KV event endpoints, from config; kvDiscover
	// asks the engine for them (kv_events_discover).
	kvEvents, kvReplay string
	kvDiscover         bool
	// nameHash is the hash of Name that ranks the backend for placement (costmodel.RendezvousRank).
	nameHash uint64

	client *http.Client
	// admin is the client for the engine's admin calls: client, with the admin key.
	admin *http.Client
	// opts is what client was built from.
	opts clientOptions
	// st is shared by the Backend values that a Reload keeps under the same name, URL
	// and role, so in-flight counts and health survive a reload that only retunes them.
	st *backendState
}

// backendState is the live state of a backend.
type backendState struct {
	inflight atomic.Int64
	// started counts the leases ever started on the backend: with inflight, how many ended.
	started atomic.Int64
	// kvEngine is the index's handle of the backend's engine, looked up by name once
	// (kvEngineIn), not on every pick; beside the counts a pick reads of every candidate, in
	// the same cache line.
	kvEngine atomic.Pointer[kvcache.Engine]
	// ranks counts the leases in flight on each data-parallel rank.
	ranks rankCounts
	// up is the active health verdict; backends start up so the proxy serves before
	// the first check round completes.
	up atomic.Bool
	// removed is set when a Reload drops the backend: leases still release on it, but
	// it is no longer picked and no longer reported.
	removed atomic.Bool
	// ejectedUntil is a UnixNano time from the router's clock; zero when never ejected.
	ejectedUntil atomic.Int64
	ejections    atomic.Int64
	// probation is set by an ejection and cleared by the next success: a backend back from
	// ejection takes one request at a time, and its first failure ejects it again. Without it
	// a dead backend with nothing in flight is every policy's first pick the moment its
	// back-off ends, and draws a burst of requests into failure.
	probation atomic.Bool
	// epoch counts the backend's returns to service: its checks bringing it up again, or its
	// probation ending. A request that left the backend avoids it only within one epoch.
	epoch atomic.Uint64
	// load is what the router scraped of the engine's load (load.go).
	load loadState
	// cost is what the cost policies keep of the engine (cost.go).
	cost costState
	// served is what the engine's /v1/models listed at its last answer.
	served servedModels
	// kvSources are where the engine said its KV event publishers are bound
	// (kv_events_discover); nil until it answered.
	kvSources atomic.Pointer[[]kvcache.Source]
	// leaving is closed when the backend goes away while up: a reload or discovery drops it,
	// or its checks take it down. A backend that comes up again gets a new one.
	leaving atomic.Pointer[leaving]

	mu sync.Mutex // guards the streaks and reasons below
	// failStreak counts passive failures in a row.
	failStreak int
	// backoffExp is the number of ejections since the last success: the next ejection
	// lasts base_backoff << backoffExp.
	backoffExp int
	// checkFails and checkPasses count active check results in a row.
	checkFails, checkPasses int
	// downReason says why up is false; ejectReason why the last ejection happened. They
	// are read only while the state they explain holds, so neither is ever cleared.
	downReason, ejectReason string
}

// rankCounts are the leases in flight on each data-parallel rank of an engine: counts is nil
// for an engine of one rank; a lease keeps a pointer to its own rank's counter, and a reload
// that changes the size swaps in new counters. next rotates the ties among ranks.
type rankCounts struct {
	counts atomic.Pointer[[]atomic.Int64]
	next   atomic.Uint64
}

// servedModels is what an engine's /v1/models listed at its last answer: models, nil until
// then, and adapters, those of models the engine serves as LoRA adapters (listed with a
// parent).
type servedModels struct {
	models, adapters atomic.Pointer[[]string]
}

// leaving is a signal, closed once.
type leaving struct {
	ch   chan struct{}
	once sync.Once
}

func newLeaving() *leaving { return &leaving{ch: make(chan struct{})} }

func (l *leaving) close() { l.once.Do(func() { close(l.ch) }) }

// Leaving is closed when the backend goes away: a reload or discovery drops it, or its health
// checks take it down (an engine that is draining, or gone). Calls in flight on it may still
// end well, but a stream that can go on elsewhere should (the proxy's migration).
func (b *Backend) Leaving() <-chan struct{} {
	if b == nil {
		return nil
	}
	return b.st.leaving.Load().ch
}

func newBackend(c routerconfig.BackendConfig, eng routerconfig.Engine, client *http.Client, st *backendState) *Backend {
	u, _ := url.Parse(c.URL) // Validate parsed it already
	if st == nil {
		st = &backendState{}
		st.up.Store(true)
		st.leaving.Store(newLeaving())
	}
	if n := c.DataParallelSize; n > 1 {
		if cur := st.ranks.counts.Load(); cur == nil || len(*cur) != n {
			// A reload that changes the size starts the ranks' counts afresh; leases in
			// flight keep counting on the counters they took.
			ranks := make([]atomic.Int64, n)
			st.ranks.counts.Store(&ranks)
		}
	} else {
		st.ranks.counts.Store(nil)
	}
	if client == nil {
		client = newClient(clientOptions{maxInflight: c.MaxInflight})
	}
	kvEvents, kvReplay := c.KVEventsEndpoint, c.KVEventsReplayEndpoint
	if kvEvents == "" && c.KVEventsPort > 0 && u != nil {
		kvEvents = "tcp://" + net.JoinHostPort(u.Hostname(), strconv.Itoa(c.KVEventsPort))
	}
	if kvReplay == "" && c.KVEventsReplayPort > 0 && u != nil {
		kvReplay = "tcp://" + net.JoinHostPort(u.Hostname(), strconv.Itoa(c.KVEventsReplayPort))
	}
	return &Backend{
		Name:          c.Name,
		URL:           u,
		URLString:     c.URL,
		Role:          c.Role,
		Engine:        eng,
		KVHoldTimeout: c.KVHoldTimeout,
		Weight:        c.Weight,
		MaxInflight:   c.MaxInflight,
		BootstrapPort: c.BootstrapPort,
		models:        slices.Clone(c.Models),
		kvEvents:      kvEvents,
		kvReplay:      kvReplay,
		kvDiscover:    c.KVEventsDiscover,
		nameHash:      xxhash.Sum64String(c.Name),
		client:        client,
		st:            st,
	}
}

// NewDetached builds a backend outside the pools, for an engine a request names rather than
// the config (llm-d's x-prefiller-host-port): Acquire never picks it, and it has no health
// checks, in-flight limit, ejection or metric series. c.URL must be an http(s) URL with a
// host; an empty c.Name becomes its host:port, a zero c.KVHoldTimeout eng's. Its calls go
// through client, which many detached backends may share (NewSharedClient).
func NewDetached(c routerconfig.BackendConfig, eng routerconfig.Engine, client *http.Client) (*Backend, error) {
	if err := routerconfig.CheckURL(c.URL); err != nil {
		return nil, err
	}
	u, _ := url.Parse(c.URL) // checkURL parsed it
	if c.Name == "" {
		c.Name = routerconfig.HostPort(u)
	}
	if c.KVHoldTimeout == 0 && eng != nil {
		c.KVHoldTimeout = eng.KVHoldTimeout()
	}
	return newBackend(c, eng, client, nil), nil
}

// NewSharedClient is a client for many detached backends at once, tuned as a pool
// backend's: its transport keeps at most perHost idle connections to each host and total in
// all, and closes one left idle for 90 s, so hosts that come and go cost nothing once idle.
func NewSharedClient(perHost, total int) *http.Client {
	c := newClient(clientOptions{maxInflight: perHost})
	c.Transport.(*http.Transport).MaxIdleConns = total
	return c
}

// clientOptions is what a backend's HTTP client is built from, resolved (the key read from
// its variable, the CA file read), so that a reload can tell whether the client must change.
type clientOptions struct {
	maxInflight int
	apiKey      string
	adminKey    string
	caPEM       string
	serverName  string
	skipVerify  bool
	// engineClient is routerconfig.Config.EngineClient; empty means routerconfig.EngineClientStdlib.
	engineClient string
}

// resolveClientOptions reads what c names outside the config: the API key's environment
// variable and the CA file. Errors name the field.
func resolveClientOptions(c routerconfig.BackendConfig) (clientOptions, error) {
	o := clientOptions{maxInflight: c.MaxInflight, apiKey: c.APIKey, serverName: c.TLSServerName, skipVerify: c.TLSInsecureSkipVerify}
	o.adminKey = c.AdminAPIKey
	if c.AdminAPIKeyEnv != "" {
		o.adminKey = os.Getenv(c.AdminAPIKeyEnv)
		if o.adminKey == "" {
			return o, fmt.Errorf("admin_api_key_env: environment variable %s is unset or empty", c.AdminAPIKeyEnv)
		}
	}
	if c.APIKeyEnv != "" {
		o.apiKey = os.Getenv(c.APIKeyEnv)
		if o.apiKey == "" {
			return o, fmt.Errorf("api_key_env: environment variable %s is unset or empty", c.APIKeyEnv)
		}
	}
	if c.TLSCAFile != "" {
		pem, err := os.ReadFile(c.TLSCAFile)
		if err != nil {
			return o, fmt.Errorf("tls_ca_file: %w", err)
		}
		if !x509.NewCertPool().AppendCertsFromPEM(pem) {
			return o, fmt.Errorf("tls_ca_file: %s holds no PEM certificate", c.TLSCAFile)
		}
		o.caPEM = string(pem)
	}
	return o, nil
}

// newClient builds a client for one engine. There is no client Timeout because
// responses stream for as long as generation takes; callers bound calls with their
// context. The idle pool matches max_inflight so a busy backend reuses connections
// instead of dialing; MaxConnsPerHost stays 0 because the router, not the transport,
// enforces the limit (a transport limit would queue invisibly). HTTP/2 stays off, on
// https too: engines speak HTTP/1.1, and one TCP connection per stream keeps an aborted
// request's close visible to the engine, which is how vLLM learns to abort.
func newClient(o clientOptions) *http.Client {
	dialer := &net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}
	tlsConf := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         o.serverName,
		InsecureSkipVerify: o.skipVerify,
	}
	if o.caPEM != "" {
		tlsConf.RootCAs = x509.NewCertPool()
		tlsConf.RootCAs.AppendCertsFromPEM([]byte(o.caPEM)) // resolveClientOptions checked it
	}
	tr := &http.Transport{
		// No Proxy: engines are reached directly; an HTTP_PROXY meant for the
		// outside world must not sit between the proxy and its engines.
		Proxy:               nil,
		DialContext:         dialer.DialContext,
		TLSClientConfig:     tlsConf,
		MaxIdleConns:        o.maxInflight,
		MaxIdleConnsPerHost: o.maxInflight,
		MaxConnsPerHost:     0,
		IdleConnTimeout:     90 * time.Second,
		TLSHandshakeTimeout: 5 * time.Second,
		// A decode asks for "100 Continue" only to learn that the decoder took it (the proxy's
		// handoff signal): its body goes out at once, never waiting for the answer.
		ExpectContinueTimeout: 0,
		ForceAttemptHTTP2:     false,
		// A connection keeps its write buffer for as long as it lives, idle once the request
		// is out, which for a stream is the whole generation: 2 KiB holds the request line,
		// headers and a short body in one write (a longer body goes out in a second write,
		// as past 4 KiB it would anyway), and saves 2 KiB of every open stream.
		WriteBufferSize: 2 << 10,
	}
	if o.engineClient == routerconfig.EngineClientLean {
		// The proxy's own HTTP/1.1 client: the same pool size, timeouts and TLS, without
		// net/http's per-connection goroutines (see h1client).
		lt := h1client.New(h1client.Options{
			DialTimeout:         dialer.Timeout,
			KeepAlive:           dialer.KeepAlive,
			IdleTimeout:         tr.IdleConnTimeout,
			MaxIdlePerHost:      max(o.maxInflight, 1),
			TLS:                 tlsConf,
			TLSHandshakeTimeout: tr.TLSHandshakeTimeout,
			// The head limit net/http's transport applies (its default, 10 MiB): an engine's
			// answer that one client takes the other takes too.
			MaxResponseHeaderBytes: tr.MaxResponseHeaderBytes,
		})
		var rt http.RoundTripper = lt
		if o.apiKey != "" {
			rt = lt.WithAuthorization("Bearer " + o.apiKey)
		}
		return &http.Client{Transport: rt, CheckRedirect: noRedirect}
	}
	var rt http.RoundTripper = tr
	if o.apiKey != "" {
		rt = &bearerTransport{value: "Bearer " + o.apiKey, base: tr}
	}
	return &http.Client{
		Transport:     rt,
		CheckRedirect: noRedirect,
	}
}

// noRedirect hands a redirect back as the answer: one from an engine would be a
// misconfiguration; surface it.
func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// bearerTransport sends a backend's own API key on every call to it. Whatever
// Authorization the request carried (a client's key) is replaced: the engine's key is
// the one the engine checks.
type bearerTransport struct {
	value string
	base  *http.Transport
}

// RoundTrip sets the key on a copy: a RoundTripper must not modify its request.
func (t *bearerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", t.value)
	return t.base.RoundTrip(req)
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the transport.
func (t *bearerTransport) CloseIdleConnections() { t.base.CloseIdleConnections() }

// Client returns the backend's HTTP client with a transport tuned for it. Use it for
// every call to this backend so connections are reused.
func (b *Backend) Client() *http.Client { return b.client }

// AdminClient is Client for the engine's admin calls: it sends admin_api_key where one is
// configured, over the same connections.
func (b *Backend) AdminClient() *http.Client {
	if b.admin != nil {
		return b.admin
	}
	return b.client
}

// withAdmin gives b its admin client when o has an admin key.
func (b *Backend) withAdmin(o clientOptions) {
	if o.adminKey == "" {
		return
	}
	base := b.client.Transport
	if lt, ok := base.(*h1client.Transport); ok {
		b.admin = &http.Client{Transport: lt.WithAuthorization("Bearer " + o.adminKey), CheckRedirect: b.client.CheckRedirect}
		return
	}
	if bt, ok := base.(*bearerTransport); ok {
		base = bt.base
	}
	tr, ok := base.(*http.Transport)
	if !ok {
		return
	}
	b.admin = &http.Client{Transport: &bearerTransport{value: "Bearer " + o.adminKey, base: tr}, CheckRedirect: b.client.CheckRedirect}
}

// Models are the models the backend serves: its configured ones, else what its engine's
// /v1/models listed last; nil while that is unknown.
func (b *Backend) Models() []string {
	if b.models != nil {
		return b.models
	}
	if p := b.st.served.models.Load(); p != nil {
		return *p
	}
	return nil
}

// Serves reports whether a request for model may go to the backend: the model is among
// its models, or those are not known yet. An empty model is any model.
func (b *Backend) Serves(model string) bool {
	if model == "" {
		return true
	}
	ms := b.Models()
	return ms == nil || slices.Contains(ms, model)
}

// Inflight is the number of leases currently counted on the backend.
func (b *Backend) Inflight() int64 { return b.st.inflight.Load() }

// Ejections is how many times passive health has ejected the backend.
func (b *Backend) Ejections() int64 { return b.st.ejections.Load() }

// String returns the backend's name, for logs.
func (b *Backend) String() string { return b.Name }

// ejected reports whether passive ejection keeps the backend out at now.
func (b *Backend) ejected(now time.Time) bool {
	until := b.st.ejectedUntil.Load()
	return until != 0 && now.UnixNano() < until
}

// available reports whether the backend may be picked, ignoring its in-flight limit.
func (b *Backend) available(now time.Time) bool {
	return b.st.up.Load() && !b.ejected(now) && !b.st.removed.Load()
}

// full reports whether the backend is at its in-flight limit.
func (b *Backend) full() bool {
	n := b.st.inflight.Load()
	return n >= int64(b.MaxInflight) || (n >= 1 && b.st.probation.Load())
}

// closeIdle drops the backend's idle connections, e.g. once it is removed.
func (b *Backend) closeIdle() { b.client.CloseIdleConnections() }

// Reasons a backend is out, as /debug/backends shows them in down_reason.
const (
	reasonChecksFailed   = "health check failed"
	reasonCheckRefused   = "health check: " // + the refusal, e.g. "health check: connection refused"
	reasonEjectFailures  = "ejected: consecutive failures"
	reasonEjectProbation = "ejected: failed on probation"
	reasonEjectRefused   = "ejected: " // + the refusal, with active checks off
)

// observe feeds one request's result to passive health and reports whether it ejected
// the backend. Failures seen while the backend is already ejected or down are from
// requests sent before and must not extend it.
func (b *Backend) observe(failed bool, now time.Time, e routerconfig.EjectionConfig) (ejectedFor time.Duration) {
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	if !failed {
		s.failStreak = 0
		if !b.ejected(now) {
			s.backoffExp = 0
			b.endProbationLocked()
		}
		return 0
	}
	if e.ConsecutiveFailures < 0 || b.ejected(now) || !s.up.Load() {
		return 0
	}
	s.failStreak++
	if s.failStreak < e.ConsecutiveFailures && !s.probation.Load() {
		return 0
	}
	why := reasonEjectFailures
	if s.probation.Load() {
		why = reasonEjectProbation
	}
	return b.ejectLocked(now, e, why)
}

// endProbationLocked ends the backend's probation, if it is on one: it is back in service.
// b.st.mu is held.
func (b *Backend) endProbationLocked() bool {
	if !b.st.probation.Swap(false) {
		return false
	}
	b.st.epoch.Add(1)
	return true
}

// answered is what a first byte of an answer tells passive health: a backend back from
// ejection that answers is alive, and its probation ends at once rather than at the end of a
// stream that may last minutes, during which it would take no other request. Its failure
// streak is left to the request's outcome: a backend that breaks every stream mid-answer is
// still ejected. It reports whether the probation ended.
func (b *Backend) answered(now time.Time) bool {
	if !b.st.probation.Load() {
		return false
	}
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	return !b.ejected(now) && b.endProbationLocked()
}

// Epoch counts the backend's returns to service (its checks bringing it up again after it was
// down, or its probation after an ejection ending): a request that left the backend when it
// failed may come back to it once its epoch has moved on, as to a new engine.
func (b *Backend) Epoch() uint64 { return b.st.epoch.Load() }

// ejectLocked takes the backend out for the next back-off and puts it on probation.
// b.st.mu is held.
func (b *Backend) ejectLocked(now time.Time, e routerconfig.EjectionConfig, why string) time.Duration {
	s := b.st
	s.probation.Store(true)
	d := e.BaseBackoff
	for i := 0; i < s.backoffExp && d < e.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, e.MaxBackoff)
	s.failStreak = 0
	s.backoffExp++
	s.ejectedUntil.Store(now.Add(d).UnixNano())
	s.ejections.Add(1)
	s.ejectReason = why
	return d
}

// markDown takes the backend out until active checks pass healthy_threshold times in a row,
// and reports whether it was up: only the first of many concurrent refusals changes it.
func (b *Backend) markDown(why string) bool {
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	return b.markDownLocked(why)
}

func (b *Backend) markDownLocked(why string) bool {
	s := b.st
	if !s.up.Load() {
		return false
	}
	s.up.Store(false)
	s.leaving.Load().close()
	s.downReason = why
	s.checkPasses, s.failStreak = 0, 0
	return true
}

// ejectRefused is markDown for when no active check would ever bring the backend back: it
// ejects it for the next back-off, on probation, whether or not passive ejection is on,
// since a refused connection is proof enough. It reports the back-off, 0 when already out.
func (b *Backend) ejectRefused(now time.Time, e routerconfig.EjectionConfig, refusal string) time.Duration {
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	if b.ejected(now) {
		return 0
	}
	return b.ejectLocked(now, e, reasonEjectRefused+refusal)
}

// check records one active check result and reports a state change (+1 up, -1 down) and,
// for a change to down, why. A check refused at connect marks the backend down at once,
// whatever unhealthy_threshold says: nothing listens there.
func (b *Backend) check(ok bool, refusal string, h routerconfig.HealthConfig) (change int, why string) {
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	if ok {
		s.checkFails = 0
		s.checkPasses++
		if !s.up.Load() && s.checkPasses >= h.HealthyThreshold {
			s.leaving.Store(newLeaving())
			s.up.Store(true)
			s.epoch.Add(1)
			return 1, ""
		}
		return 0, ""
	}
	s.checkPasses = 0
	s.checkFails++
	why = reasonChecksFailed
	if refusal != "" {
		why = reasonCheckRefused + refusal
	} else if s.checkFails < h.UnhealthyThreshold {
		return 0, ""
	}
	if b.markDownLocked(why) {
		return -1, why
	}
	return 0, ""
}

// outReason says why the backend may not be picked at now: down, ejected, or "" when it
// may be.
func (b *Backend) outReason(now time.Time) string {
	s := b.st
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case !s.up.Load():
		return s.downReason
	case b.ejected(now):
		return s.ejectReason
	}
	return ""
}
