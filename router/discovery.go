package router

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// discoveryLookupTimeout bounds one lookup, so that a DNS server that never answers delays a
// refresh (and a config apply) by this much at most. Go's resolver alone could retry for
// longer (resolv.conf's timeout times attempts, per search domain).
const discoveryLookupTimeout = 5 * time.Second

// discovery keeps the router's discover entries resolved. Every change of a name's addresses
// applies through Router.apply, the path of Reload, so a discovered backend that goes away is
// drained as a removed one is: its requests in flight finish, and it gets no new one.
type discovery struct {
	r *Router
	// errors counts failed lookups by entry name.
	errors *prometheus.CounterVec
	// wake tells run that the entries changed (buffered 1).
	wake chan struct{}
	// templates are the discover entries in force, for Has and MinKVHoldTimeout, which must
	// not wait for mu (held across lookups).
	templates atomic.Pointer[[]routerconfig.BackendConfig]

	// mu serializes installs and refreshes, and guards what follows.
	mu sync.Mutex
	// declared is the config in force as validated, with the discover entries unexpanded.
	declared routerconfig.Config
	resolver routerconfig.Resolver
	entries  map[string]*dnsEntry // by entry name
}

// dnsEntry is one discover entry and what its name resolved to.
type dnsEntry struct {
	cfg        routerconfig.BackendConfig // defaults filled
	u          *url.URL
	host, port string
	// addrs is the last good set, sorted and without duplicates.
	addrs []netip.Addr
	// next is when the name is resolved again.
	next time.Time
	// failing is set while lookups fail, so that a streak is logged once.
	failing bool
}

func newDiscovery(r *Router) *discovery {
	return &discovery{
		r:    r,
		wake: make(chan struct{}, 1),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "discovery_errors_total",
			Help: "DNS lookups of a discover entry's name that failed (a timeout, SERVFAIL, an unreachable server): the entry's last good set of backends stays. By the entry's name.",
		}, []string{"backend"}),
	}
}

// backend is the config of the backend at address a: the entry's, with the address.
func (e *dnsEntry) backend(a netip.Addr) routerconfig.BackendConfig {
	c := e.cfg
	c.Discover, c.Refresh = "", 0
	hp := net.JoinHostPort(a.String(), e.port)
	u := *e.u
	u.Host = hp
	c.URL = u.String()
	// Stable across refreshes and reloads, so that a backend keeps its state while its
	// address stays in the answer.
	c.Name = e.cfg.Name + "/" + hp
	if u.Scheme == "https" && c.TLSServerName == "" {
		// Certificates name the Service, not the pod's address.
		c.TLSServerName = e.host
	}
	return c
}

// expand replaces every discover entry of cfg by its backends, in address order.
func expand(cfg routerconfig.Config, entries map[string]*dnsEntry) routerconfig.Config {
	out := cfg
	out.Backends = make([]routerconfig.BackendConfig, 0, len(cfg.Backends))
	for _, b := range cfg.Backends {
		if b.Discover == "" {
			out.Backends = append(out.Backends, b)
			continue
		}
		if e := entries[b.Name]; e != nil {
			for _, a := range e.addrs {
				out.Backends = append(out.Backends, e.backend(a))
			}
		}
	}
	return out
}

// lookupResult is what one lookup found.
type lookupResult struct {
	addrs []netip.Addr
	err   error
}

// lookup resolves host. A name with no record (NXDOMAIN, or no A nor AAAA) is an answer, not a
// failure: a headless Service with no ready pod is such a name, and its pool is empty.
func lookup(ctx context.Context, res routerconfig.Resolver, host string) lookupResult {
	ctx, cancel := context.WithTimeout(ctx, discoveryLookupTimeout)
	defer cancel()
	ips, err := res.LookupNetIP(ctx, "ip", host)
	if dnsErr := (*net.DNSError)(nil); errors.As(err, &dnsErr) && dnsErr.IsNotFound {
		return lookupResult{}
	}
	if err != nil {
		return lookupResult{err: err}
	}
	out := make([]netip.Addr, 0, len(ips))
	for _, a := range ips {
		out = append(out, a.Unmap())
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return lookupResult{addrs: slices.Compact(out)}
}

// lookupAll resolves the entries' names at once, so one slow name does not delay the others.
func lookupAll(ctx context.Context, res routerconfig.Resolver, es []*dnsEntry) []lookupResult {
	out := make([]lookupResult, len(es))
	var wg sync.WaitGroup
	for i, e := range es {
		wg.Go(func() { out[i] = lookup(ctx, res, e.host) })
	}
	wg.Wait()
	return out
}

// install applies cfg (validated, defaults filled): the running discover entries that it keeps
// (same name, url and role) keep their last good set; new ones are resolved now, so that the
// config applies with their backends. New and Reload take no context: those lookups are
// bounded by discoveryLookupTimeout instead, and a name that does not resolve yet applies with
// no backend, for run to try again.
func (d *discovery) install(cfg routerconfig.Config) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	res := cfg.Resolver
	if res == nil {
		res = net.DefaultResolver
	}
	now := time.Now()
	entries := make(map[string]*dnsEntry)
	var templates []routerconfig.BackendConfig
	var fresh []*dnsEntry
	for _, b := range cfg.Backends {
		if b.Discover == "" {
			continue
		}
		templates = append(templates, b)
		u, _ := url.Parse(b.URL) // Validate parsed it
		host, port, _ := net.SplitHostPort(routerconfig.HostPort(u))
		e := &dnsEntry{cfg: b, u: u, host: host, port: port, next: now.Add(b.Refresh)}
		if o := d.entries[b.Name]; o != nil && o.cfg.URL == b.URL && o.cfg.Role == b.Role {
			e.addrs, e.failing = o.addrs, o.failing
			if o.next.Before(e.next) {
				e.next = o.next // the sooner of its schedule and one (new) refresh from now
			}
		} else {
			fresh = append(fresh, e)
		}
		entries[b.Name] = e
	}
	ctx, cancel := context.WithTimeout(context.Background(), discoveryLookupTimeout)
	results := lookupAll(ctx, res, fresh)
	cancel()
	for i, e := range fresh {
		e.addrs = results[i].addrs
	}
	if err := d.r.apply(expand(cfg, entries)); err != nil {
		return err
	}
	for name := range d.entries {
		if entries[name] == nil {
			d.errors.DeleteLabelValues(name)
		}
	}
	for name := range entries {
		d.errors.WithLabelValues(name) // a series at 0 from the start, so rate() sees the first error
	}
	for i, e := range fresh {
		d.report(e, results[i], nil, e.addrs)
		if results[i].err == nil && len(e.addrs) == 0 {
			d.r.logger.Warn("dns discovery found no address: the pool is empty", zap.String("backend", e.cfg.Name), zap.String("host", e.host))
		}
	}
	d.declared, d.resolver, d.entries = cfg, res, entries
	d.templates.Store(&templates)
	d.r.forgetModels()
	select {
	case d.wake <- struct{}{}:
	default:
	}
	return nil
}

// report counts and logs what a lookup of e found, once it applied: a failure, a recovery, a
// change of the set from old to now.
func (d *discovery) report(e *dnsEntry, res lookupResult, old, now []netip.Addr) {
	name := e.cfg.Name
	if res.err != nil {
		d.errors.WithLabelValues(name).Inc()
		msg, lvl := "dns discovery failed: the last good backends stay", zap.WarnLevel
		if e.failing {
			lvl = zap.DebugLevel // logged once a streak; the counter counts every one
		}
		e.failing = true
		if ce := d.r.logger.Check(lvl, msg); ce != nil {
			ce.Write(zap.String("backend", name), zap.String("host", e.host), zap.Int("backends", len(e.addrs)), zap.Error(res.err))
		}
		return
	}
	if e.failing {
		e.failing = false
		d.r.logger.Info("dns discovery answers again", zap.String("backend", name), zap.String("host", e.host))
	}
	added, removed := diffAddrs(old, now)
	if len(added)+len(removed) == 0 {
		return
	}
	fields := []zap.Field{zap.String("backend", name), zap.String("host", e.host), zap.Int("backends", len(now)),
		zap.Strings("added", added), zap.Strings("removed", removed)}
	if len(now) == 0 {
		d.r.logger.Warn("dns discovery found no address: the pool is empty", fields...)
		return
	}
	d.r.logger.Info("dns discovery changed the backends", fields...)
}

// diffAddrs lists what is in b and not in a, and what is in a and not in b; both are sorted.
func diffAddrs(a, b []netip.Addr) (added, removed []string) {
	for _, x := range b {
		if _, ok := slices.BinarySearchFunc(a, x, netip.Addr.Compare); !ok {
			added = append(added, x.String())
		}
	}
	for _, x := range a {
		if _, ok := slices.BinarySearchFunc(b, x, netip.Addr.Compare); !ok {
			removed = append(removed, x.String())
		}
	}
	return added, removed
}

// run resolves every discover entry again each refresh until ctx is done. Router.Run owns it.
func (d *discovery) run(ctx context.Context) {
	timer := time.NewTimer(0)
	timer.Stop()
	defer timer.Stop()
	for {
		due, res, wait := d.due(time.Now())
		if len(due) > 0 {
			d.refresh(ctx, res, due)
			continue
		}
		var tick <-chan time.Time
		if wait > 0 {
			timer.Reset(wait)
			tick = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-tick:
		}
	}
}

// due returns the entries whose refresh has come, scheduling their next, the resolver, and how
// long until the next one is due (0: no entry).
func (d *discovery) due(now time.Time) (due []*dnsEntry, res routerconfig.Resolver, wait time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.entries {
		if !e.next.After(now) {
			due = append(due, e)
			e.next = now.Add(e.cfg.Refresh)
		}
		if w := max(e.next.Sub(now), time.Nanosecond); wait == 0 || w < wait {
			wait = w
		}
	}
	return due, d.resolver, wait
}

// refresh resolves the names of es again and applies what changed. A failed lookup keeps its
// entry's last good set.
func (d *discovery) refresh(ctx context.Context, res routerconfig.Resolver, es []*dnsEntry) {
	results := lookupAll(ctx, res, es)
	if ctx.Err() != nil {
		return // shutting down: a lookup cut short says nothing about the name
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	olds := make([][]netip.Addr, len(es))
	changed := false
	for i, e := range es {
		olds[i] = e.addrs
		if d.entries[e.cfg.Name] != e {
			continue // a reload replaced the entry meanwhile: its own lookup is newer
		}
		if r := results[i]; r.err == nil && !slices.Equal(r.addrs, e.addrs) {
			e.addrs, changed = r.addrs, true
		}
	}
	if changed {
		if err := d.r.apply(expand(d.declared, d.entries)); err != nil {
			// Only what apply reads outside the config can fail here (a CA file, a key's
			// variable), and would fail the same for every backend: stay as before.
			for i, e := range es {
				e.addrs = olds[i]
			}
			d.r.logger.Error("dns discovery could not apply the backends it found", zap.Error(err))
			return
		}
	}
	for i, e := range es {
		if d.entries[e.cfg.Name] == e {
			d.report(e, results[i], olds[i], e.addrs)
		}
	}
}

// declares reports whether a discover entry of role is in force, whatever it resolves to.
func (d *discovery) declares(role routerconfig.Role) bool {
	for _, b := range d.entryTemplates() {
		if b.Role == role {
			return true
		}
	}
	return false
}

// holds lists the kv_hold_timeout of the discover entries of role.
func (d *discovery) holds(role routerconfig.Role) []time.Duration {
	var out []time.Duration
	for _, b := range d.entryTemplates() {
		if b.Role == role {
			out = append(out, b.KVHoldTimeout)
		}
	}
	return out
}

func (d *discovery) entryTemplates() []routerconfig.BackendConfig {
	if p := d.templates.Load(); p != nil {
		return *p
	}
	return nil
}
