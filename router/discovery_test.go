package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// fakeResolver answers from a table that the test changes: a list of addresses, no record
// (NXDOMAIN), or a failure (SERVFAIL).
type fakeResolver struct {
	mu      sync.Mutex
	answers map[string]fakeAnswer
	lookups int
}

type fakeAnswer struct {
	addrs    []string
	notFound bool
	fail     bool
}

func newFakeResolver() *fakeResolver { return &fakeResolver{answers: map[string]fakeAnswer{}} }

func (f *fakeResolver) set(host string, a fakeAnswer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.answers[host] = a
}

func (f *fakeResolver) LookupNetIP(_ context.Context, network, host string) ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lookups++
	a, ok := f.answers[host]
	switch {
	case network != "ip":
		return nil, fmt.Errorf("network %q, want ip (A and AAAA)", network)
	case !ok || a.notFound:
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	case a.fail:
		return nil, &net.DNSError{Err: "server misbehaving", Name: host, IsTemporary: true}
	}
	var out []netip.Addr
	for _, s := range a.addrs {
		out = append(out, netip.MustParseAddr(s))
	}
	return out, nil
}

func addrs(s ...string) fakeAnswer { return fakeAnswer{addrs: s} }

// poolCfg is a decoder pool named "pool" on pool.ns.svc:8100, resolved by res, and one plain
// prefiller.
func poolCfg(res routerconfig.Resolver) routerconfig.Config {
	return routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "p0", URL: "http://127.0.0.1:9000", Role: routerconfig.RolePrefill},
			{Name: "pool", URL: "http://pool.ns.svc:8100", Role: routerconfig.RoleDecode, Discover: routerconfig.DiscoverDNS,
				Weight: 3, MaxInflight: 2, Engine: "sim", KVHoldTimeout: 7 * time.Second, APIKey: "k"},
		},
		Resolver: res,
	}
}

// refreshNow resolves every discover entry once, as run does when their refresh comes.
func refreshNow(t *testing.T, r *Router) {
	t.Helper()
	r.disc.mu.Lock()
	var es []*dnsEntry
	for _, e := range r.disc.entries {
		es = append(es, e)
	}
	res := r.disc.resolver
	r.disc.mu.Unlock()
	r.disc.refresh(context.Background(), res, es)
}

func names(r *Router, role routerconfig.Role) []string {
	var out []string
	for _, b := range r.Backends() {
		if b.Role == role {
			out = append(out, b.Name)
		}
	}
	return out
}

func TestADiscoverEntryIsOneBackendPerAddressWithTheEntrysSettings(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.6", "10.0.0.5", "10.0.0.5", "::ffff:10.0.0.7", "fd00::1"))
	r, reg, _ := newTestRouter(t, poolCfg(res))

	want := []string{"pool/10.0.0.5:8100", "pool/10.0.0.6:8100", "pool/10.0.0.7:8100", "pool/[fd00::1]:8100"}
	if got := names(r, routerconfig.RoleDecode); !slices.Equal(got, want) {
		t.Fatalf("decoders %v, want %v: one per distinct address, in order, resolved by New", got, want)
	}
	b := backendByName(t, r, "pool/10.0.0.5:8100")
	if b.URLString != "http://10.0.0.5:8100" || b.Weight != 3 || b.MaxInflight != 2 || b.Engine.Kind() != "sim" ||
		b.KVHoldTimeout != 7*time.Second || b.opts.apiKey != "k" {
		t.Errorf("discovered backend %+v does not carry the entry's settings", b)
	}
	if got := r.MinKVHoldTimeout(routerconfig.RoleDecode); got != 7*time.Second {
		t.Errorf("MinKVHoldTimeout(decode) = %v, want the entry's 7s", got)
	}
	if v, ok := testutil.Lookup(t, reg, "pdproxy_discovery_errors_total", map[string]string{"backend": "pool"}); !ok || v != 0 {
		t.Errorf("pdproxy_discovery_errors_total{backend=pool} = %v (present %v), want a series at 0", v, ok)
	}
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	if !strings.HasPrefix(l.Backend().Name, "pool/") {
		t.Errorf("picked %s", l.Backend().Name)
	}
	l.Release(Result{Status: 200})
}

func TestADiscoveredHTTPSBackendVerifiesTheDNSName(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5"))
	res.set("other.ns.svc", addrs("10.0.0.9"))
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "pool", URL: "https://pool.ns.svc", Role: routerconfig.RoleDecode, Discover: routerconfig.DiscoverDNS},
		{Name: "other", URL: "https://other.ns.svc:8443", Role: routerconfig.RoleDecode, Discover: routerconfig.DiscoverDNS, TLSServerName: "engines.internal"},
	}, Resolver: res}
	r, _, _ := newTestRouter(t, cfg)
	for _, tc := range []struct{ name, url, serverName string }{
		{"pool/10.0.0.5:443", "https://10.0.0.5:443", "pool.ns.svc"},
		{"other/10.0.0.9:8443", "https://10.0.0.9:8443", "engines.internal"},
	} {
		b := backendByName(t, r, tc.name)
		if b.URLString != tc.url || b.opts.serverName != tc.serverName {
			t.Errorf("%s: url %s, tls server name %q; want %s and %q", tc.name, b.URLString, b.opts.serverName, tc.url, tc.serverName)
		}
	}
}

func TestARefreshAddsNewAddressesAndDrainsGoneOnes(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5", "10.0.0.6"))
	r, reg, _ := newTestRouter(t, poolCfg(res))

	// A request in flight on .6, and .5 ejected: state that a kept backend must keep.
	onGone := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"pool/10.0.0.5:8100"}})
	kept := backendByName(t, r, "pool/10.0.0.5:8100")
	for range routerconfig.DefaultConsecutiveFailures {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"pool/10.0.0.6:8100"}})
		l.Release(Result{Status: 500})
	}
	if kept.Ejections() != 1 {
		t.Fatalf("setup: .5 ejections %d", kept.Ejections())
	}

	res.set("pool.ns.svc", addrs("10.0.0.5", "10.0.0.7"))
	refreshNow(t, r)
	if got, want := names(r, routerconfig.RoleDecode), []string{"pool/10.0.0.5:8100", "pool/10.0.0.7:8100"}; !slices.Equal(got, want) {
		t.Fatalf("after .6 left and .7 came: %v, want %v", got, want)
	}
	if b := backendByName(t, r, "pool/10.0.0.5:8100"); b.st != kept.st || b.Ejections() != 1 {
		t.Error("the backend kept by the refresh lost its state")
	}
	// The request on the gone .6 ends as usual; .6 gets no new one.
	for range 10 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		if l.Backend().Name != "pool/10.0.0.7:8100" {
			t.Fatalf("picked %s, want .7 (.5 ejected, .6 gone)", l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
	if n := onGone.Backend().Inflight(); n != 1 {
		t.Errorf("gone backend in flight %d, want its 1 request", n)
	}
	onGone.Release(Result{Status: 200})
	if n := onGone.Backend().Inflight(); n != 0 {
		t.Errorf("gone backend in flight %d after its request ended", n)
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_backend_requests_total", map[string]string{"backend": "pool/10.0.0.6:8100"}); ok {
		t.Error("the gone backend's series stayed")
	}
	assertAllIdle(t, r)
}

func TestAFailedLookupKeepsTheLastGoodSetAndIsCounted(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5", "10.0.0.6"))
	r, reg, _ := newTestRouter(t, poolCfg(res))
	want := names(r, routerconfig.RoleDecode)
	errs := func() float64 {
		return testutil.Value(t, reg, "pdproxy_discovery_errors_total", map[string]string{"backend": "pool"})
	}

	res.set("pool.ns.svc", fakeAnswer{fail: true})
	for i := range 3 {
		refreshNow(t, r)
		if got := names(r, routerconfig.RoleDecode); !slices.Equal(got, want) {
			t.Fatalf("after failed lookup %d: %v, want the last good %v", i+1, got, want)
		}
	}
	if got := errs(); got != 3 {
		t.Errorf("pdproxy_discovery_errors_total = %v, want 3", got)
	}
	send(t, r, Result{Status: 200})

	res.set("pool.ns.svc", addrs("10.0.0.6"))
	refreshNow(t, r)
	if got, want := names(r, routerconfig.RoleDecode), []string{"pool/10.0.0.6:8100"}; !slices.Equal(got, want) {
		t.Errorf("once it answers again: %v, want %v", got, want)
	}
	if got := errs(); got != 3 {
		t.Errorf("pdproxy_discovery_errors_total = %v after a good answer, want still 3", got)
	}
}

func TestANameWithNoRecordEmptiesThePool(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5"))
	cfg := poolCfg(res)
	cfg.Backends[0], cfg.Backends[1] = cfg.Backends[1], cfg.Backends[0]
	cfg.Backends[0].Role, cfg.Backends[1].Role = routerconfig.RolePrefill, routerconfig.RoleDecode // a pool of prefillers
	r, reg, _ := newTestRouter(t, cfg)

	res.set("pool.ns.svc", fakeAnswer{notFound: true}) // e.g. a headless Service with no ready pod
	refreshNow(t, r)
	if got := names(r, routerconfig.RolePrefill); len(got) != 0 {
		t.Fatalf("prefillers %v after NXDOMAIN, want none", got)
	}
	if _, err := r.Acquire(context.Background(), routerconfig.RolePrefill, Hint{}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("Acquire(prefill) = %v, want ErrNoBackend", err)
	}
	if !r.Has(routerconfig.RolePrefill) {
		t.Error("Has(prefill) = false: the entry is configured, only empty now")
	}
	if got := r.MinKVHoldTimeout(routerconfig.RolePrefill); got != 7*time.Second {
		t.Errorf("MinKVHoldTimeout(prefill) = %v with the pool empty, want the entry's 7s", got)
	}
	if got := testutil.Value(t, reg, "pdproxy_discovery_errors_total", nil); got != 0 {
		t.Errorf("an answer with no record counted as %v errors", got)
	}
}

func TestReloadKeepsAnEntrysAddressesAndResolvesANewOne(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5"))
	res.set("more.ns.svc", addrs("10.0.1.1", "10.0.1.2"))
	cfg := poolCfg(res)
	r, reg, _ := newTestRouter(t, cfg)
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})

	// The DNS answer changed, but a reload alone does not look the kept entry up again: the
	// refresh does, on its schedule. The new entry is resolved before Reload returns.
	res.set("pool.ns.svc", addrs("10.0.0.5", "10.0.0.6"))
	cfg.Backends = append(cfg.Backends, routerconfig.BackendConfig{Name: "more", URL: "http://more.ns.svc:8100", Role: routerconfig.RoleDecode, Discover: routerconfig.DiscoverDNS})
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if got, want := names(r, routerconfig.RoleDecode), []string{"pool/10.0.0.5:8100", "more/10.0.1.1:8100", "more/10.0.1.2:8100"}; !slices.Equal(got, want) {
		t.Fatalf("after the reload: %v, want %v", got, want)
	}
	if got := backendByName(t, r, "pool/10.0.0.5:8100").Inflight(); got != 1 {
		t.Errorf("kept discovered backend in flight %d, want 1", got)
	}

	cfg.Backends = cfg.Backends[:2] // drops "more"
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_discovery_errors_total", map[string]string{"backend": "more"}); ok {
		t.Error("a removed entry's error series stayed")
	}
	refreshNow(t, r)
	if got, want := names(r, routerconfig.RoleDecode), []string{"pool/10.0.0.5:8100", "pool/10.0.0.6:8100"}; !slices.Equal(got, want) {
		t.Errorf("after the refresh: %v, want %v", got, want)
	}
	l.Release(Result{Status: 200})
	assertAllIdle(t, r)
}

func TestRunResolvesEveryRefreshUntilItsContextEnds(t *testing.T) {
	res := newFakeResolver()
	res.set("pool.ns.svc", addrs("10.0.0.5"))
	cfg := poolCfg(res)
	cfg.Backends[1].Refresh = 10 * time.Millisecond
	r, _, _ := newTestRouter(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	res.set("pool.ns.svc", addrs("10.0.0.5", "10.0.0.6"))
	testutil.Eventually(t, testutil.Timeout, func() bool { return len(names(r, routerconfig.RoleDecode)) == 2 }, "the second address to be added by Run")
	res.set("pool.ns.svc", addrs("10.0.0.6"))
	testutil.Eventually(t, testutil.Timeout, func() bool { return slices.Equal(names(r, routerconfig.RoleDecode), []string{"pool/10.0.0.6:8100"}) }, "the first address to be removed by Run")
	cancel()
	if err := testutil.Recv(t, testutil.Timeout, done, "Run to return"); err != nil {
		t.Errorf("Run = %v", err)
	}
	res.mu.Lock()
	n := res.lookups
	res.mu.Unlock()
	time.Sleep(30 * time.Millisecond)
	res.mu.Lock()
	defer res.mu.Unlock()
	if res.lookups != n {
		t.Errorf("%d lookups after Run returned", res.lookups-n)
	}
}

func TestDiscoverConfig(t *testing.T) {
	decoder := routerconfig.BackendConfig{Name: "d", URL: "http://d:1", Role: routerconfig.RoleDecode}
	pool := routerconfig.BackendConfig{Name: "pool", URL: "http://pool:1", Role: routerconfig.RoleDecode, Discover: routerconfig.DiscoverDNS}
	t.Run("refresh defaults to 5s", func(t *testing.T) {
		cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{pool}}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		if got := cfg.Backends[0].Refresh; got != routerconfig.DefaultRefresh {
			t.Errorf("refresh = %v, want %v", got, routerconfig.DefaultRefresh)
		}
	})
	withRefresh := decoder
	withRefresh.Refresh = time.Second
	badMode := pool
	badMode.Discover = "srv"
	negative := pool
	negative.Refresh = -time.Second
	taken := decoder
	taken.Name = "pool/10.0.0.1:1"
	for _, tc := range []struct {
		name string
		bs   []routerconfig.BackendConfig
		want string
	}{
		{"refresh on a plain url", []routerconfig.BackendConfig{withRefresh}, "backends[0].refresh: set, but discover is not"},
		{"an unknown discover mode", []routerconfig.BackendConfig{decoder, badMode}, `backends[1].discover: "srv" is not "dns"`},
		{"a negative refresh", []routerconfig.BackendConfig{negative}, "backends[0].refresh: -1s is negative"},
		{"a name among the discovered ones", []routerconfig.BackendConfig{pool, taken}, `backends[1].name: "pool/10.0.0.1:1" is among the names of the backends that backends[0] discovers`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := routerconfig.Config{Backends: tc.bs}
			err := cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want %q", err, tc.want)
			}
		})
	}
}
