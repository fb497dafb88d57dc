package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// backendView is one backend of /debug/backends as a client reads the JSON.
type backendView struct {
	Name       string `json:"name"`
	Healthy    bool   `json:"healthy"`
	Ejected    bool   `json:"ejected"`
	DownReason string `json:"down_reason"`
	// Load is the engine's load at the replica's last scrape, where its pool scrapes.
	Load *struct {
		Waiting int64 `json:"waiting"`
		Running int64 `json:"running"`
		// Alone: the engine served no request but this replica's lately.
		Alone *bool `json:"alone"`
	} `json:"load"`
}

func viewBackend(t *testing.T, base, name string) backendView {
	t.Helper()
	resp, err := http.Get(base + "/debug/backends")
	if err != nil {
		t.Fatalf("GET /debug/backends: %v", err)
	}
	defer resp.Body.Close()
	var bs []backendView
	if err := json.NewDecoder(resp.Body).Decode(&bs); err != nil {
		t.Fatalf("decode /debug/backends: %v", err)
	}
	for _, b := range bs {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("no backend %s in /debug/backends", name)
	return backendView{}
}

// A decoder killed with SIGKILL refuses the next connection: that one call takes it out
// until its health check passes again, instead of every request finding out on its own
// each time an ejection ends.
func TestAKilledDecoderIsMarkedDownByOneRefusedCallAndBackByItsHealthCheck(t *testing.T) {
	simArgs := []string{"sim", "--role", "decode", "--itl", "2ms", "--listen"}
	victimProc, victimAddr := startProcess(t, "sim engine listening", append(simArgs, "127.0.0.1:0")...)
	_, survivorAddr := startProcess(t, "sim engine listening", append(simArgs, "127.0.0.1:0")...)
	const interval = time.Second
	s := startStack(t, func(c *app.Config) {
		c.Sims = nil // decode-only: the two decoder processes are the backends
		c.Router.Backends = []routerconfig.BackendConfig{
			{Name: "victim", URL: "http://" + victimAddr, Role: routerconfig.RoleDecode, Engine: "sim"},
			{Name: "survivor", URL: "http://" + survivorAddr, Role: routerconfig.RoleDecode, Engine: "sim"},
		}
		// Failed checks alone would take a minute to notice the death; a check that passes
		// brings the victim back within a second of its restart.
		c.Router.Health.Interval = interval
		c.Router.Health.UnhealthyThreshold = 60
	})
	callsTo := func(name string) float64 {
		return testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", map[string]string{"backend": name})
	}

	const workers = 4
	var (
		mu      sync.Mutex
		results []outcome
		wg      sync.WaitGroup
		stop    = make(chan struct{})
		once    sync.Once
	)
	stopLoad := func() { once.Do(func() { close(stop) }); wg.Wait() }
	defer stopLoad()
	shapes := loadShapes(20)
	for w := range workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				o := send(ctx, s.url, shapes[(w+i)%len(shapes)])
				cancel()
				mu.Lock()
				results = append(results, o)
				mu.Unlock()
			}
		})
	}
	finishedSince := func(after time.Time) (n int, failed []string) {
		mu.Lock()
		defer mu.Unlock()
		for _, o := range results {
			if o.start.After(after) {
				n++
				if o.kind != "ok" {
					failed = append(failed, o.kind)
				}
			}
		}
		return n, failed
	}

	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		v, sv := callsTo("victim"), callsTo("survivor")
		return v >= 5 && sv >= 5, fmt.Sprintf("calls: victim %v, survivor %v", v, sv)
	})
	victimProc.stop(syscall.SIGKILL)
	killed := time.Now()

	// The first call refused takes it out. The deadline is for a broken build; on a working
	// one this is the time of one failed call.
	var st backendView
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		st = viewBackend(t, s.url, "victim")
		return !st.Healthy && !st.Ejected && strings.Contains(st.DownReason, "connection refused"),
			fmt.Sprintf("the killed decoder shows %+v, want healthy false, down_reason \"connection refused\"", st)
	})
	down := time.Now()
	t.Logf("marked down %s after the kill: %+v", down.Sub(killed).Round(time.Millisecond), st)
	if got := testutil.Value(t, s.m.Registry, "pdproxy_backend_down_total", map[string]string{"backend": "victim", "reason": "connection_refused"}); got != 1 {
		t.Errorf("pdproxy_backend_down_total{backend=victim,reason=connection_refused} = %v, want 1", got)
	}

	// From then on no request goes to it, across several health intervals and over a second:
	// its calls stop counting, every request succeeds.
	// Calls picked just before the mark may still end; let them.
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		n, _ := finishedSince(down)
		return n >= 2*workers, fmt.Sprintf("%d requests finished since the mark", n)
	})
	settled := time.Now()
	callsAtMark := callsTo("victim")
	testutil.WaitFor(t, 20*time.Second, func() (bool, string) {
		n, _ := finishedSince(settled)
		return time.Since(settled) > 3*interval && n >= 20, fmt.Sprintf("%d requests in %s", n, time.Since(settled).Round(time.Millisecond))
	})
	if got := callsTo("victim"); got != callsAtMark {
		t.Errorf("pdproxy_backend_requests_total{backend=victim} went from %v to %v while it was down: requests still probe a dead backend", callsAtMark, got)
	}
	if n, failed := finishedSince(settled); len(failed) > 0 {
		t.Errorf("%d of %d requests started after the victim was marked down failed: %v", len(failed), n, failed)
	}
	if st := viewBackend(t, s.url, "victim"); st.Healthy {
		t.Fatalf("the dead decoder came back: %+v", st)
	}

	// Restarted on the same port, its health check brings it back and requests reach it.
	startProcess(t, "sim engine listening", append(simArgs, victimAddr)...)
	testutil.WaitFor(t, 3*interval+5*time.Second, func() (bool, string) {
		st := viewBackend(t, s.url, "victim")
		return st.Healthy && st.DownReason == "", fmt.Sprintf("the restarted decoder shows %+v", st)
	})
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return callsTo("victim") > callsAtMark, "no request reached the restarted decoder"
	})
	stopLoad()
	for _, o := range results {
		if !o.clean {
			t.Errorf("a request ended badly: %s", o.kind)
		}
	}
	t.Logf("%d requests: %s", len(results), tally(results))
}
