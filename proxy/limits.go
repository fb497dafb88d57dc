package proxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// SharedState is what the proxy needs of the state the replicas share (sharedstate.Store):
// one decision per request under its identity's per_key limits, with its session's bindings
// read in the same round trip, and its slot given back when the request ends; and a
// session's binding to the engine a pick chose (session_affinity), written off the request's
// path (it may drop the write under pressure: the session's key still places it). Given to
// New by WithSharedState; when it fails, this replica decides on its own state, as with no
// shared state.
type SharedState interface {
	Check(ctx context.Context, req sharedstate.Request) (sharedstate.Decision, error)
	Release(slot sharedstate.Slot)
	Bind(session, role, engine string, ttl time.Duration)
	pdflow.Placements
}

var _ SharedState = (*sharedstate.Store)(nil)

// LimitsConfig gives each client identity its own share of the proxy: a concurrency limit
// and a token-bucket rate limit, refused with 429 (Retry-After) before the body is read and
// before any engine is asked, so that a refusal never counts against a backend.
//
// The identity is the client's API key, the token of "Authorization: Bearer <key>" (else of x-api-key). With no
// keys configured (api_keys_file, api_keys_env) the token is whatever the client sends, so it
// is a label the client chooses, not an authenticated name; a request without one is known by
// its connection's IP address (behind a load balancer, the balancer's). With TenantHeader
// set, the identity is the key and that header's value together: tenants behind one key each
// get the whole per_key budget.
type LimitsConfig struct {
	// PerKey are the limits each identity gets. All zero (the default) means none.
	PerKey KeyLimits `yaml:"per_key"`
	// TenantHeader names a request header (e.g. X-Tenant) whose value splits a key into
	// tenants with a budget each. Only a gateway that sets it for the client should be
	// trusted with it: a client that sets it itself can pick a fresh budget per value.
	// Empty, the default, means the key alone is the identity.
	TenantHeader string `yaml:"tenant_header"`
	// MaxIdentities bounds how many identities the proxy keeps state for at once. An
	// identity with nothing in flight and a full bucket is dropped (it would start afresh
	// anyway); when the bound is reached the proxy drops those, then identities with
	// nothing in flight (their buckets start full again when they come back); a new identity
	// finding every kept one with requests in flight is refused with 429 (reason capacity).
	// [DefaultMaxIdentities]
	MaxIdentities int `yaml:"max_identities"`
}

// KeyLimits are one identity's limits. Zero means unlimited, for each.
type KeyLimits struct {
	// MaxConcurrent bounds the identity's requests in flight through the proxy (from their
	// arrival until their answer ends, a stream included). One more is refused with 429 and
	// Retry-After: 1.
	MaxConcurrent int `yaml:"max_concurrent"`
	// RequestsPerSecond is the rate at which the identity's token bucket refills: each
	// request takes a token, and one that finds none is refused with 429 and a Retry-After of
	// the seconds until a token is due (at least 1).
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	// Burst is the bucket's size: how many requests may come at once after a quiet spell.
	// [requests_per_second rounded up, at least 1]
	Burst int `yaml:"burst"`
}

const (
	// DefaultMaxIdentities is limits.max_identities when it is not set.
	DefaultMaxIdentities = 10000
	// labelsKept bounds the distinct keys (when no keys are configured) and tenants that
	// metrics show by name; the others are counted as "other".
	labelsKept = 64
	// limitsSweepEvery is how often idle identities are dropped when the map is not full.
	limitsSweepEvery = 10 * time.Second
)

// Reasons a request is refused by its limits: the reason label of
// pdproxy_limit_rejected_total.
const (
	limitConcurrency = "concurrency"
	limitRate        = "rate"
	limitCapacity    = "capacity"
)

func (c *LimitsConfig) setDefaults() error {
	l := &c.PerKey
	if l.MaxConcurrent < 0 {
		return fmt.Errorf("limits.per_key.max_concurrent: %d is negative", l.MaxConcurrent)
	}
	if l.RequestsPerSecond < 0 || math.IsNaN(l.RequestsPerSecond) || math.IsInf(l.RequestsPerSecond, 0) {
		return fmt.Errorf("limits.per_key.requests_per_second: %v is not a non-negative number", l.RequestsPerSecond)
	}
	if l.Burst < 0 {
		return fmt.Errorf("limits.per_key.burst: %d is negative", l.Burst)
	}
	if l.Burst > 0 && l.RequestsPerSecond == 0 {
		return fmt.Errorf("limits.per_key.burst: needs requests_per_second")
	}
	if l.RequestsPerSecond > 0 && l.Burst == 0 {
		l.Burst = max(1, int(math.Ceil(l.RequestsPerSecond)))
	}
	if c.MaxIdentities < 0 {
		return fmt.Errorf("limits.max_identities: %d is negative", c.MaxIdentities)
	}
	if c.MaxIdentities == 0 {
		c.MaxIdentities = DefaultMaxIdentities
	}
	return nil
}

// on reports whether any identity is limited or split into tenants.
func (c LimitsConfig) on() bool {
	return c.PerKey.MaxConcurrent > 0 || c.PerKey.RequestsPerSecond > 0 || c.TenantHeader != ""
}

// identity is a client's key and tenant, hashed: the map holds no client-sized string.
type identity [sha256.Size]byte

// share is one identity's state. Guarded by limiter.mu.
type share struct {
	inflight int
	tokens   float64
	at       time.Time // when tokens was last brought up to date
}

// limiter holds every identity's share and the names metrics show them by.
type limiter struct {
	cfg          LimitsConfig
	tenantHeader string
	// shared decides the per_key limits across replicas; nil when each replica decides
	// alone. The shares here are kept either way: they decide when shared fails.
	shared SharedState
	// sessionHeaders name a request's session (session_affinity), whose bindings the shared
	// check reads too.
	sessionHeaders []string

	mu        sync.Mutex
	shares    map[identity]*share
	lastSweep time.Time

	// names bounds the key and tenant label values (labelsKept, or every configured key).
	names labelSet
	// now is the buckets' clock: time.Now; tests move their own.
	now func() time.Time
}

func newLimiter(cfg LimitsConfig, keys int) *limiter {
	l := &limiter{cfg: cfg, shares: make(map[identity]*share), now: time.Now}
	if cfg.TenantHeader != "" {
		l.tenantHeader = http.CanonicalHeaderKey(cfg.TenantHeader)
	}
	l.names.maxKeys = max(labelsKept, keys)
	return l
}

// admission is one request let in by its limits, until release. The handler may set its
// class (classify); the rest is the limiter's.
type admission struct {
	share       *share // nil when no limit applies
	slot        sharedstate.Slot
	id          identity
	key, tenant string // label values
	class       string // label value; "" until the request's class is known
	// bindings are the engines the request's session was bound to, by role, as the shared
	// check of the limits read them; read says that check asked for them, so that the
	// session is not asked again (nil bindings when the check failed).
	bindings map[string]string
	read     bool
}

type admissionKey struct{}

// admissionOf is the request's admission; nil when neither limits nor classes are configured.
func admissionOf(ctx context.Context) *admission {
	a, _ := ctx.Value(admissionKey{}).(*admission)
	return a
}

// admit lets r in or refuses it (with an error). It reads only r's headers and address. The
// admission it returns carries the labels either way.
func (l *limiter) admit(r *http.Request, now time.Time) (*admission, *api.Error) {
	raw, name := clientIdentity(r)
	tenant := ""
	if l.tenantHeader != "" {
		tenant = r.Header.Get(l.tenantHeader)
	}
	h := sha256.New()
	h.Write([]byte(raw))
	h.Write([]byte{0})
	h.Write([]byte(tenant))
	var id identity
	h.Sum(id[:0])
	key, tlabel := l.names.label(name, tenant, l.tenantHeader != "")
	a := &admission{key: key, tenant: tlabel, id: id}
	lim := l.cfg.PerKey
	if lim.MaxConcurrent == 0 && lim.RequestsPerSecond == 0 {
		return a, nil // only counted
	}

	l.mu.Lock()
	defer l.mu.Unlock() // held again when admitShared returns
	if now.Sub(l.lastSweep) >= limitsSweepEvery {
		l.sweepLocked(now, false)
	}
	s := l.shares[id]
	if s == nil {
		if len(l.shares) >= l.cfg.MaxIdentities {
			l.sweepLocked(now, true)
		}
		if len(l.shares) >= l.cfg.MaxIdentities {
			return a, refusal(limitCapacity, 1, "the proxy is serving requests for too many clients at once; retry later")
		}
		s = &share{tokens: float64(lim.Burst), at: now}
		l.shares[id] = s
	}
	l.refillLocked(s, now)
	if l.shared != nil {
		session, _ := sessionOf(r, l.sessionHeaders) // a bad one is refused by the handler
		return l.admitShared(r.Context(), a, s, session)
	}
	if e := l.decideLocked(s); e != nil {
		return a, e
	}
	a.share = s
	return a, nil
}

// decideLocked is this replica's decision on its own state: s's request is let in (counted
// in flight, a token taken) or refused.
func (l *limiter) decideLocked(s *share) *api.Error {
	lim := l.cfg.PerKey
	if lim.MaxConcurrent > 0 && s.inflight >= lim.MaxConcurrent {
		return refusal(limitConcurrency, 1, concurrencyMessage(lim))
	}
	if lim.RequestsPerSecond > 0 {
		if s.tokens < 1 {
			// Less a hair, so that float rounding does not make a whole second of 8.000000001.
			wait := int(math.Ceil((1-s.tokens)/lim.RequestsPerSecond - 1e-9))
			return refusal(limitRate, max(wait, 1), rateMessage(lim))
		}
		s.tokens--
	}
	s.inflight++
	return nil
}

// admitShared has the shared state decide, with l.mu held on entry (and released while the
// shared state is asked). This replica's share counts the request too when it is let in
// (in flight, and a token while there is one), so that if the shared state fails, the
// replica goes on from what it has been serving rather than from an empty slate.
func (l *limiter) admitShared(ctx context.Context, a *admission, s *share, session string) (*admission, *api.Error) {
	lim := l.cfg.PerKey
	s.inflight++ // while the shared state decides: no sweep drops the share meanwhile
	l.mu.Unlock()
	req := sharedstate.Request{Key: hex.EncodeToString(a.id[:]), Rate: lim.RequestsPerSecond, Burst: lim.Burst, MaxConcurrent: lim.MaxConcurrent}
	if session != "" {
		// The session's bindings come in the same round trip.
		req.SessionKeys = []string{session}
	}
	d, err := l.shared.Check(ctx, req)
	if session != "" {
		// Asked once, whatever the answer: a check that failed (counted there) leaves the
		// key alone to place the session, and is not asked again for it.
		a.bindings, a.read = d.Bindings[session], true
	}
	l.mu.Lock()
	s.inflight--
	switch {
	case err != nil:
		// The shared state could not decide (its own count and log say why): this
		// replica's limits do, and a slot it kept for the request goes back on a refusal.
		if e := l.decideLocked(s); e != nil {
			l.shared.Release(d.Slot)
			return a, e
		}
	case !d.Allowed && d.Reason == sharedstate.ReasonConcurrency:
		return a, refusal(limitConcurrency, 1, concurrencyMessage(lim))
	case !d.Allowed:
		// Less a hair, as above: a wait of exactly 2s is 2, not 3.
		wait := int(math.Ceil(d.RetryAfter.Seconds() - 1e-9))
		return a, refusal(limitRate, max(wait, 1), rateMessage(lim))
	default:
		s.inflight++
		if lim.RequestsPerSecond > 0 {
			s.tokens = max(s.tokens-1, 0)
		}
	}
	a.share, a.slot = s, d.Slot
	return a, nil
}

func concurrencyMessage(lim KeyLimits) string {
	return fmt.Sprintf("too many concurrent requests for this API key: at most %d in flight; retry when one ends", lim.MaxConcurrent)
}

func rateMessage(lim KeyLimits) string {
	return fmt.Sprintf("rate limit reached for this API key: %g requests per second, burst %d; retry later", lim.RequestsPerSecond, lim.Burst)
}

// release ends an admission: its request left the proxy.
func (l *limiter) release(a *admission, now time.Time) {
	if a.share == nil {
		return
	}
	if l.shared != nil {
		l.shared.Release(a.slot)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	a.share.inflight--
	if a.share.inflight < 0 {
		a.share.inflight = 0 // cannot happen: one release per admission
	}
	// An idle share is dropped at the next sweep; with no rate limit it is idle at once.
	if a.share.inflight == 0 && l.cfg.PerKey.RequestsPerSecond == 0 && l.shares[a.id] == a.share {
		delete(l.shares, a.id)
	}
	a.share = nil
}

func (l *limiter) refillLocked(s *share, now time.Time) {
	lim := l.cfg.PerKey
	if lim.RequestsPerSecond == 0 {
		return
	}
	if d := now.Sub(s.at); d > 0 {
		s.tokens = min(float64(lim.Burst), s.tokens+d.Seconds()*lim.RequestsPerSecond)
	}
	s.at = now
}

// sweepLocked drops the idle shares (nothing in flight, a full bucket). full, for a map
// at its bound, drops shares with nothing in flight too until an eighth of it is free, so
// that the next sweep is that many new identities away.
func (l *limiter) sweepLocked(now time.Time, full bool) {
	l.lastSweep = now
	for id, s := range l.shares {
		if s.inflight != 0 {
			continue
		}
		l.refillLocked(s, now)
		if l.cfg.PerKey.RequestsPerSecond == 0 || s.tokens >= float64(l.cfg.PerKey.Burst) {
			delete(l.shares, id)
		}
	}
	if !full {
		return
	}
	target := l.cfg.MaxIdentities - max(l.cfg.MaxIdentities/8, 1)
	for id, s := range l.shares {
		if len(l.shares) <= target {
			return
		}
		if s.inflight == 0 {
			delete(l.shares, id)
		}
	}
}

// identities is how many identities the limiter keeps state for.
func (l *limiter) identities() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.shares)
}

func refusal(reason string, retryAfter int, msg string) *api.Error {
	e := api.NewError(api.KindRateLimited, msg).With("", fmt.Errorf("limit: %s", reason), retryAfter)
	e.Limit = reason
	return e
}

// clientIdentity is the raw identity of r's client (its bearer token, else its IP) and the
// name metrics show it by: key- or ip- and the first 8 hex digits of its SHA-256, never
// the key itself.
func clientIdentity(r *http.Request) (raw, name string) {
	if tok, ok := clientKey(r); ok {
		return "key\x00" + tok, "key-" + shortHash(tok)
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	return "ip\x00" + host, "ip-" + shortHash(host)
}

func shortHash(s string) string {
	d := sha256.Sum256([]byte(s))
	return hex.EncodeToString(d[:4])
}

// labelSet keeps the key and tenant label values a closed set: the first names seen, up to
// their bounds, and "other" after.
type labelSet struct {
	maxKeys int
	mu      sync.Mutex
	keys    map[string]bool
	tenants map[string]bool
}

// label returns the label values for a key's name and a tenant ("" when tenants are off
// or the request named none).
func (n *labelSet) label(key, tenant string, tenants bool) (string, string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.keys == nil {
		n.keys, n.tenants = make(map[string]bool), make(map[string]bool)
	}
	if !n.keys[key] {
		if len(n.keys) >= n.maxKeys {
			key = "other"
		} else {
			n.keys[key] = true
		}
	}
	if !tenants || tenant == "" {
		return key, ""
	}
	if !n.tenants[tenant] {
		if len(n.tenants) >= labelsKept || len(tenant) > 64 || !printable(tenant) {
			return key, "other"
		}
		n.tenants[tenant] = true
	}
	return key, tenant
}
