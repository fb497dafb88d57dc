package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// errTransport is a call that broke after its connection was made, which counts toward
// ejection like a 5xx.
var errTransport = &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}

// refusedErr is the error of a real call to an address where nothing listens, wrapped as
// the proxy passes it on.
func refusedErr(t *testing.T) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := &http.Client{Transport: &http.Transport{}}
	defer c.CloseIdleConnections()
	resp, err := c.Get("http://" + addr + "/v1/completions")
	if err == nil {
		resp.Body.Close()
		t.Fatalf("a call to closed %s succeeded", addr)
	}
	return fmt.Errorf("call http://%s/v1/completions: %w", addr, err)
}

// send acquires the only decoder and releases it with res.
func send(t *testing.T, r *Router, res Result) {
	t.Helper()
	mustAcquire(t, r, routerconfig.RoleDecode, Hint{}).Release(res)
}

func TestPassiveHealthCountsOnlyBackendFaults(t *testing.T) {
	fail5xx := Result{Status: 503}
	tests := []struct {
		name        string
		results     []Result
		wantEjected bool
	}{
		{"three 5xx in a row eject", []Result{fail5xx, fail5xx, fail5xx}, true},
		{"three transport errors in a row eject", []Result{{Err: errTransport}, {Err: errTransport}, {Err: errTransport}}, true},
		{"a success resets the streak", []Result{fail5xx, fail5xx, {Status: 200}, fail5xx, fail5xx}, false},
		{"client cancels count nothing", []Result{fail5xx, fail5xx, {Canceled: true, Err: context.Canceled}, {Canceled: true}}, false},
		{"4xx is the client's fault, not the backend's", []Result{{Status: 400}, {Status: 404}, {Status: 429}}, false},
		{"an unused lease counts nothing", []Result{fail5xx, fail5xx, {}, {}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)})
			for _, res := range tt.results {
				send(t, r, res)
			}
			st := r.Backends()[0]
			if st.Ejected != tt.wantEjected || r.Ready() == tt.wantEjected {
				t.Errorf("ejected = %v, ready = %v; want ejected %v", st.Ejected, r.Ready(), tt.wantEjected)
			}
			if tt.wantEjected {
				if _, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{}); !errors.Is(err, ErrNoBackend) {
					t.Errorf("Acquire on ejected pool = %v, want ErrNoBackend", err)
				}
			}
		})
	}
}

func TestEjectionBackoffDoublesUpToMax(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{
		Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0),
		Ejection: routerconfig.EjectionConfig{ConsecutiveFailures: 2, BaseBackoff: time.Second, MaxBackoff: 3 * time.Second},
	})
	fail := func() {
		send(t, r, Result{Status: 500})
		if r.Ready() { // back from an ejection, one failure is enough (probation)
			send(t, r, Result{Status: 500})
		}
	}
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 3 * time.Second} {
		fail()
		if r.Ready() {
			t.Fatalf("ejection %d: still ready", i+1)
		}
		clk.Advance(want - time.Millisecond)
		if r.Ready() {
			t.Fatalf("ejection %d: back before %v", i+1, want)
		}
		clk.Advance(time.Millisecond)
		if !r.Ready() {
			t.Fatalf("ejection %d: still out after %v", i+1, want)
		}
		if got := r.Backends()[0].Ejections; got != int64(i+1) {
			t.Errorf("ejections = %d, want %d", got, i+1)
		}
	}
	// A success after coming back restarts the backoff at base.
	send(t, r, Result{Status: 200})
	fail()
	clk.Advance(time.Second)
	if !r.Ready() {
		t.Error("backoff did not restart at base after a success")
	}
}

func TestFailuresDuringEjectionDoNotExtendIt(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)})
	// Six requests in flight when the backend breaks: twice the threshold.
	var leases []*Lease
	for range 6 {
		leases = append(leases, mustAcquire(t, r, routerconfig.RoleDecode, Hint{}))
	}
	for _, l := range leases {
		l.Release(Result{Status: 502})
	}
	if got := r.Backends()[0].Ejections; got != 1 {
		t.Errorf("ejections = %d, want 1 for one outage", got)
	}
	clk.Advance(routerconfig.DefaultBaseBackoff)
	if !r.Ready() {
		t.Error("late failures extended the ejection")
	}
}

func TestPassiveEjectionCanBeDisabled(t *testing.T) {
	// Two decoders take two requests at a time, one each (least_inflight); d0 fails every
	// one it gets, with 5xx answers and broken connections, d1 serves every one. Enabled,
	// ejection takes d0 out after its third failure and d1 serves the rest; disabled, d0
	// keeps its share of every round and is never ejected.
	const rounds = 10
	for _, tc := range []struct {
		name          string
		failures      int // EjectionConfig.ConsecutiveFailures
		wantPicks     int // of d0, over the rounds
		wantEjections int64
	}{
		{"enabled, the failing backend is ejected", 3, 3, 1},
		{"disabled, the failing backend keeps its share", -1, rounds, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _, _ := newTestRouter(t, routerconfig.Config{
				Backends:     backendsCfg(routerconfig.RoleDecode, "d", 2, 0),
				DecodePolicy: "least_inflight",
				Ejection:     routerconfig.EjectionConfig{ConsecutiveFailures: tc.failures},
			})
			d0 := backendByName(t, r, "d0")
			picks := map[string]int{}
			for i := range rounds {
				a, b := mustAcquire(t, r, routerconfig.RoleDecode, Hint{}), mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
				for _, l := range []*Lease{a, b} {
					picks[l.Backend().Name]++
					switch {
					case l.Backend() != d0:
						l.Release(Result{Status: 200})
					case i%2 == 0:
						l.Release(Result{Status: 503})
					default:
						l.Release(Result{Err: errTransport})
					}
				}
			}
			if picks["d0"] != tc.wantPicks || picks["d1"] != 2*rounds-tc.wantPicks {
				t.Errorf("picks %v over %d rounds of two; want d0 %d", picks, rounds, tc.wantPicks)
			}
			if got := d0.Ejections(); got != tc.wantEjections {
				t.Errorf("d0 ejected %d times, want %d", got, tc.wantEjections)
			}
			for _, st := range r.Backends() {
				if st.Name == "d0" && st.Ejected != (tc.wantEjections > 0) {
					t.Errorf("after the rounds d0 is ejected %v, want %v", st.Ejected, tc.wantEjections > 0)
				}
			}
			assertAllIdle(t, r)
		})
	}
}

func TestEjectedBackendTrafficGoesElsewhere(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)})
	for range 3 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
		l.Release(Result{Err: errTransport})
	}
	for range 5 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		if l.Backend().Name != "d1" {
			t.Fatalf("picked ejected %s", l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
	clk.Advance(routerconfig.DefaultBaseBackoff)
	seen := map[string]bool{}
	for range 4 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		seen[l.Backend().Name] = true
		l.Release(Result{Status: 200})
	}
	if !seen["d0"] {
		t.Error("d0 never picked after its ejection ended")
	}
}

func TestABackendBackFromEjectionTakesOneRequestUntilItSucceeds(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "flaky", URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode},
			{Name: "steady", URL: "http://127.0.0.1:2", Role: routerconfig.RoleDecode},
		},
		Ejection: routerconfig.EjectionConfig{ConsecutiveFailures: 2, BaseBackoff: time.Second, MaxBackoff: 8 * time.Second},
	})
	flaky := backendByName(t, r, "flaky")
	failOn := func(b *Backend) {
		for flaky.Inflight() == 0 {
			l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"steady"}})
			if err != nil {
				t.Fatalf("acquire flaky: %v", err)
			}
			l.Release(Result{Status: 503})
			if flaky.Ejections() > 0 {
				return
			}
		}
	}
	failOn(flaky)
	if flaky.Ejections() != 1 {
		t.Fatalf("ejections %d, want 1", flaky.Ejections())
	}
	clk.Advance(time.Second)

	// Back, on probation: one request may go to it; the next ones go elsewhere.
	probe, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"steady"}})
	if err != nil {
		t.Fatalf("probe: %v", err)
	}
	for i := 0; i < 5; i++ {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{})
		if err != nil {
			t.Fatal(err)
		}
		if l.Backend().Name != "steady" {
			t.Fatalf("request %d went to %s while the probe was in flight", i, l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
	// The probe fails: ejected again at once, for twice as long.
	probe.Release(Result{Status: 503})
	if flaky.Ejections() != 2 {
		t.Fatalf("ejections %d after a failed probe, want 2", flaky.Ejections())
	}
	clk.Advance(2 * time.Second)
	// A successful probe ends the probation: it takes requests in parallel again.
	probe, err = r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"steady"}})
	if err != nil {
		t.Fatal(err)
	}
	probe.Release(Result{Status: 200})
	a, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"steady"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"steady"}})
	if err != nil {
		t.Fatalf("second parallel request after a good probe: %v", err)
	}
	a.Release(Result{Status: 200})
	b.Release(Result{Status: 200})
}

// A stream's first byte proves a backend back from an ejection alive: its probation ends then,
// not when the stream does, and a request queued for it goes at once; a stream that then breaks
// still counts against it.
func TestABackendOnProbationTakesRequestsAgainFromItsFirstByte(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{
		Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0),
		Ejection: routerconfig.EjectionConfig{ConsecutiveFailures: 1, BaseBackoff: time.Second, MaxBackoff: 8 * time.Second},
	})
	d := r.decode.backends[0]
	send(t, r, Result{Status: 503})
	if d.Ejections() != 1 {
		t.Fatalf("ejections %d, want 1", d.Ejections())
	}
	before := d.Epoch()
	clk.Advance(time.Second)
	stream := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	queuedAcquire := acquireAsync(t, r, context.Background(), Hint{})
	stream.Answered()
	second := testutil.Recv(t, testutil.Timeout, queuedAcquire, "the queued request to go after the stream's first byte")
	if second.err != nil {
		t.Fatal(second.err)
	}
	if d.Epoch() == before {
		t.Fatal("the end of probation did not move the backend's epoch")
	}
	second.lease.Release(Result{Status: 200})
	stream.Release(Result{Err: errTransport})
	if d.Ejections() != 2 {
		t.Fatalf("ejections %d after the stream broke, want 2: a first byte must not excuse a failure", d.Ejections())
	}
}
