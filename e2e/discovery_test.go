package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// dnsServer is a real DNS server on loopback (UDP), authoritative for the names the test
// gives it: A records from a table the test changes, no AAAA record, NXDOMAIN for any other
// name, or SERVFAIL for every query while failing.
type dnsServer struct {
	addr string
	srv  *dns.Server
	done chan error
	stop func()

	mu       sync.Mutex
	records  map[string][]netip.Addr // by fully qualified name
	servfail bool
	queries  atomic.Int64
}

func startDNS(t *testing.T) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &dnsServer{addr: pc.LocalAddr().String(), done: make(chan error, 1), records: map[string][]netip.Addr{}}
	started := make(chan struct{})
	s.srv = &dns.Server{PacketConn: pc, Handler: s, NotifyStartedFunc: func() { close(started) }}
	go func() { s.done <- s.srv.ActivateAndServe() }()
	testutil.Recv(t, testutil.Timeout, started, "the DNS server to start")
	s.stop = sync.OnceFunc(func() {
		if err := s.srv.Shutdown(); err != nil {
			t.Errorf("dns shutdown: %v", err)
		}
		if err := <-s.done; err != nil {
			t.Errorf("dns server: %v", err)
		}
	})
	t.Cleanup(s.stop)
	return s
}

// set makes name answer with the addresses ips.
func (s *dnsServer) set(name string, ips ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var as []netip.Addr
	for _, ip := range ips {
		as = append(as, netip.MustParseAddr(ip))
	}
	s.records[dns.Fqdn(name)] = as
}

func (s *dnsServer) setServfail(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.servfail = on
}

// ServeDNS implements dns.Handler.
func (s *dnsServer) ServeDNS(w dns.ResponseWriter, q *dns.Msg) {
	s.queries.Add(1)
	m := new(dns.Msg)
	m.SetReply(q)
	m.Authoritative = true
	s.mu.Lock()
	if s.servfail {
		m.Rcode = dns.RcodeServerFailure
	} else {
		for _, qq := range q.Question {
			as, ok := s.records[strings.ToLower(qq.Name)]
			if !ok {
				m.Rcode = dns.RcodeNameError
				continue
			}
			if qq.Qtype != dns.TypeA {
				continue // the name exists, with no record of that type
			}
			for _, a := range as {
				m.Answer = append(m.Answer, &dns.A{
					Hdr: dns.RR_Header{Name: qq.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1},
					A:   a.AsSlice(),
				})
			}
		}
	}
	s.mu.Unlock()
	_ = w.WriteMsg(m) // a client that left is no concern of the server
}

// resolver is a Go resolver that asks s whatever server resolv.conf names.
func (s *dnsServer) resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, s.addr)
	}}
}

// listenOnOnePort listens on the same free TCP port of every host, as the pods behind one
// Service name do: a DNS record carries an address, the port comes from the URL.
func listenOnOnePort(t *testing.T, hosts ...string) (port string, lns []net.Listener) {
	t.Helper()
	for range 20 {
		first, err := net.Listen("tcp", hosts[0]+":0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ = net.SplitHostPort(first.Addr().String())
		lns = []net.Listener{first}
		for _, h := range hosts[1:] {
			ln, err := net.Listen("tcp", net.JoinHostPort(h, port))
			if err != nil {
				break // the port is taken on that address: try another
			}
			lns = append(lns, ln)
		}
		if len(lns) == len(hosts) {
			return port, lns
		}
		for _, ln := range lns {
			ln.Close()
		}
	}
	t.Fatalf("no port free on all of %v", hosts)
	return "", nil
}

// startSimOn runs a simulated engine on ln until the test ends.
func startSimOn(t *testing.T, ln net.Listener, mutate func(*sim.Config)) string {
	t.Helper()
	cfg := sim.DefaultConfig()
	mutate(&cfg)
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	srv := httptest.NewUnstartedServer(eng.Handler())
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
	})
	return srv.URL
}

// TestDNSDiscoveryFollowsThePoolUnderLoadAndNoRequestFails: the decoders are the A records of a
// name on a real DNS server; under steady load a record is added (its engine gets traffic), one
// is removed (its streams finish, it gets nothing new), then the server answers SERVFAIL and
// then stops (the backends stay, each failed lookup is counted), and no client sees a failure.
func TestDNSDiscoveryFollowsThePoolUnderLoadAndNoRequestFails(t *testing.T) {
	const name = "decode.pd.test"
	ns := startDNS(t)
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	port, lns := listenOnOnePort(t, ips...)
	urls := map[string]string{}
	for i, ip := range ips {
		urls[ip] = startSimOn(t, lns[i], func(c *sim.Config) {
			c.Role = "decode"
			c.ITL = 3 * time.Millisecond
		})
	}
	backend := func(ip string) string { return "decode/" + net.JoinHostPort(ip, port) }
	ns.set(name, ips[0], ips[1])

	const refresh = 100 * time.Millisecond
	s := startStack(t, fastSims, func(c *app.Config) {
		c.Sims = c.Sims[:1] // the prefiller; the decoders come from DNS
		c.Router.Backends = []routerconfig.BackendConfig{{
			Name: "decode", URL: "http://" + net.JoinHostPort(name, port), Role: routerconfig.RoleDecode,
			Engine: "sim", Discover: routerconfig.DiscoverDNS, Refresh: refresh,
		}}
		c.Router.Resolver = ns.resolver()
	})
	decoders := func() []string {
		var out []string
		for _, b := range s.m.Router.Backends() {
			if b.Role == routerconfig.RoleDecode {
				out = append(out, b.Name)
			}
		}
		slices.Sort(out)
		return out
	}
	if got, want := decoders(), []string{backend(ips[0]), backend(ips[1])}; !slices.Equal(got, want) {
		t.Fatalf("decoders at start %v, want %v", got, want)
	}
	discoveryErrors := func() float64 {
		return testutil.Value(t, s.m.Registry, "pdproxy_discovery_errors_total", map[string]string{"backend": "decode"})
	}

	// Steady load: workers send requests one after another until told to stop.
	shapes := loadShapes(20)
	const workers, perWorker = 4, 250
	var (
		mu      sync.Mutex
		results []outcome
		wg      sync.WaitGroup
		stop    = make(chan struct{})
	)
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopLoad()
	record := func(o outcome) {
		mu.Lock()
		results = append(results, o)
		mu.Unlock()
	}
	// busy holds each worker's request start (UnixNano), 0 between requests.
	busy := make([]atomic.Int64, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				select {
				case <-stop:
					return
				default:
				}
				busy[w].Store(time.Now().UnixNano())
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				o := send(ctx, s.url, shapes[(w+i)%len(shapes)])
				cancel()
				busy[w].Store(0)
				record(o)
			}
		})
	}
	finished := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(results)
	}
	// moreFinished waits until n more requests have finished: the load goes on across each step.
	moreFinished := func(n int) {
		t.Helper()
		want := finished() + n
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			return finished() >= want, fmt.Sprintf("%d of %d requests finished", finished(), want)
		})
	}
	served := func(ip string) int { return kv(t, urls[ip]).RequestsTotal }

	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return served(ips[0]) > 0 && served(ips[1]) > 0 && finished() >= 5*workers,
			fmt.Sprintf("%d finished; served by .2 %d, .3 %d", finished(), served(ips[0]), served(ips[1]))
	})

	// A pod appears: its record is added, and its engine gets traffic.
	added := time.Now()
	ns.set(name, ips...)
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return slices.Contains(decoders(), backend(ips[2])), fmt.Sprintf("decoders %v", decoders())
	})
	addedListed := time.Since(added)
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return served(ips[2]) > 0, "the new decoder served nothing"
	})
	addedServed := time.Since(added)
	moreFinished(10 * workers)

	// A pod goes away while streams run on it: long ones, so that some are on it when the
	// router lets it go.
	long := `{"model":"sim","prompt":"` + prompt(50) + `","max_tokens":300,"ignore_eos":true,"stream":true}`
	for range 6 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			record(send(ctx, s.url, loadShape{"/v1/completions", long, true}))
		})
	}
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		st := kv(t, urls[ips[0]])
		return st.RunningRequests >= 2, fmt.Sprintf(".2 runs %d requests", st.RunningRequests)
	})
	removed := time.Now()
	ns.set(name, ips[1], ips[2])
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return !slices.Contains(decoders(), backend(ips[0])), fmt.Sprintf("decoders %v", decoders())
	})
	gone := time.Now()
	onGone := kv(t, urls[ips[0]]).RunningRequests
	if onGone == 0 {
		t.Fatalf("nothing ran on .2 when the router let it go %s after its record was removed: the test proves nothing", gone.Sub(removed))
	}
	// Every request that started before .2 left the router may still be sent to it; once they
	// have all ended and its streams are done, it never gets another.
	testutil.WaitFor(t, 20*time.Second, func() (bool, string) {
		for w := range busy {
			if at := busy[w].Load(); at != 0 && at < gone.UnixNano() {
				return false, fmt.Sprintf("worker %d's request from before .2 left still runs", w)
			}
		}
		st := kv(t, urls[ips[0]])
		return st.RunningRequests == 0 && st.WaitingRequests == 0, fmt.Sprintf(".2 still runs %d, %d waiting", st.RunningRequests, st.WaitingRequests)
	})
	drained := time.Since(gone)
	servedByGone := served(ips[0])
	moreFinished(10 * workers)
	if got := served(ips[0]); got != servedByGone {
		t.Errorf(".2 got %d new requests after it left the pool", got-servedByGone)
	}

	// DNS breaks: SERVFAIL, then no server at all. The last good set stays, every failed
	// lookup is counted.
	want := decoders()
	if e := discoveryErrors(); e != 0 {
		t.Fatalf("%v discovery errors while the server answered", e)
	}
	failing := time.Now()
	before := finished()
	ns.setServfail(true)
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return discoveryErrors() >= 5, fmt.Sprintf("%v discovery errors", discoveryErrors())
	})
	servfailErrors := discoveryErrors()
	moreFinished(8 * workers)
	ns.stop()
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return discoveryErrors() >= servfailErrors+5, fmt.Sprintf("%v discovery errors", discoveryErrors())
	})
	moreFinished(8 * workers)
	if got := decoders(); !slices.Equal(got, want) {
		t.Errorf("decoders %v while DNS failed, want the last good %v", got, want)
	}
	duringFailure, failedFor := finished()-before, time.Since(failing)
	stopLoad()

	failed := 0
	for _, o := range results {
		if o.kind != "ok" {
			failed++
			t.Errorf("a request failed: %s", o.kind)
		}
	}
	t.Logf("%d requests, %d failed, %d workers plus 6 long streams", len(results), failed, workers)
	t.Logf("record added: listed after %s, first request on it after %s", addedListed.Round(time.Millisecond), addedServed.Round(time.Millisecond))
	t.Logf("record removed: out of the pool after %s with %d requests running on it; those finished %s later; %d served by it in all, none after",
		gone.Sub(removed).Round(time.Millisecond), onGone, drained.Round(time.Millisecond), servedByGone)
	t.Logf("DNS failing for %s (SERVFAIL, then stopped): %v lookups failed (%v SERVFAIL), %d requests served meanwhile, pool %v kept",
		failedFor.Round(time.Millisecond), discoveryErrors(), servfailErrors, duringFailure, want)
	t.Logf("served: .2 %d, .3 %d, .4 %d; %d DNS queries answered", served(ips[0]), served(ips[1]), served(ips[2]), ns.queries.Load())

	// Nothing left behind: every engine's KV free, no request or hold in the table, every
	// lease released, the removed decoder's included.
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		for _, u := range append(s.m.SimURLs("prefill"), urls[ips[0]], urls[ips[1]], urls[ips[2]]) {
			st := kv(t, u)
			if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 || st.DoubleFreeAttemptsTotal != 0 {
				return false, fmt.Sprintf("%s: %s", u, jsonString(st))
			}
		}
		return true, ""
	})
	s.assertQuiet(5 * time.Second)
}
