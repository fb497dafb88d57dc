package router

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// countingEngines are engines that report no load and count the requests every client sent
// them, as vLLM's vllm:request_success_total does.
type countingEngines struct {
	mu      sync.Mutex
	engines map[string]*metricsEngine
	served  map[string]int
}

func newCountingEngines(t *testing.T, n int) (*countingEngines, []routerconfig.BackendConfig) {
	t.Helper()
	c := &countingEngines{engines: map[string]*metricsEngine{}, served: map[string]int{}}
	var backends []routerconfig.BackendConfig
	for i := range n {
		name := fmt.Sprintf("d%d", i)
		c.engines[name] = newMetricsEngine(t, c.body(0))
		backends = append(backends, routerconfig.BackendConfig{Name: name, URL: c.engines[name].URL, Role: routerconfig.RoleDecode})
	}
	return c, backends
}

func (c *countingEngines) body(served int) string {
	return testutil.VLLMMetrics(0, 0, 0) + fmt.Sprintf("vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} %d\n", served)
}

// serve counts a request on engine.
func (c *countingEngines) serve(engine string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.served[engine]++
	c.engines[engine].set(200, c.body(c.served[engine]))
}

// pick sends h through r and has the engine picked count it.
func (c *countingEngines) pick(t *testing.T, r *Router, h Hint) string {
	t.Helper()
	name, _ := pickOnce(t, r, h)
	c.serve(name)
	return name
}

// countingReplicas are n routers on cache_aware, without shared state, over c's engines,
// each running until the test ends and having read every engine's count once.
func countingReplicas(t *testing.T, n int, backends []routerconfig.BackendConfig) []*Router {
	t.Helper()
	rs := replicas(t, n, func() routerconfig.Config {
		return routerconfig.Config{Backends: backends, DecodePolicy: routerconfig.PolicyCacheAware, ScrapeInterval: 20 * time.Millisecond,
			Health: routerconfig.HealthConfig{Interval: -1}}
	}, true)
	for i, r := range rs {
		for _, b := range r.backends() {
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				l := b.st.load.last.Load()
				return l != nil && l.Requests >= 0, fmt.Sprintf("replica %d to read %s's count of requests", i, b.Name)
			})
		}
	}
	return rs
}

// A single replica without shared state, whose engines count no request but its own, spreads
// prompts no engine holds by what it sent each engine lately: new prompts fall evenly over
// the engines, not as their heads' hashes fall.
func TestAReplicaAloneSpreadsNewPromptsEvenly(t *testing.T) {
	const prompts = 40
	c, backends := newCountingEngines(t, 4)
	r := countingReplicas(t, 1, backends)[0]
	perEngine := map[string]int{}
	for i := range prompts {
		perEngine[c.pick(t, r, Hint{Text: conversation(i)})]++
	}
	counts := slices.Collect(maps.Values(perEngine))
	if len(counts) != 4 || slices.Max(counts)-slices.Min(counts) > 2 {
		t.Errorf("%d new prompts of one size through a replica alone went %v; want each of 4 engines within 2 of the others", prompts, perEngine)
	}
}

// Replicas without shared state whose engines count each other's requests place a prompt no
// engine holds alike, by its rendezvous order, as replicas without shared state must: spread by what
// each alone sent, the same prompt would go to a different engine from each.
func TestReplicasThatSeeEachOthersRequestsPlaceANewPromptAlike(t *testing.T) {
	const prompts = 300
	c, backends := newCountingEngines(t, 4)
	rs := countingReplicas(t, 3, backends)
	// Traffic through every replica in turn, until every replica has read, on every engine,
	// requests it did not send.
	warm := 0
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		for _, r := range rs {
			c.pick(t, r, Hint{Text: conversation(100000 + warm)})
			warm++
		}
		time.Sleep(25 * time.Millisecond) // a scrape
		for i, r := range rs {
			for _, b := range r.backends() {
				if b.sole(r.now()) {
					return false, fmt.Sprintf("replica %d to see another's requests on %s (after %d warm-up requests)", i, b.Name, warm)
				}
			}
		}
		return true, ""
	})
	where := make([][]string, len(rs))
	for k, r := range rs {
		where[k] = make([]string, prompts)
		for j := range prompts {
			i := j
			if k == 1 {
				i = prompts - 1 - j // each replica in its own order
			}
			where[k][i] = c.pick(t, r, Hint{Text: conversation(i)})
		}
	}
	for i := range prompts {
		if where[0][i] != where[1][i] || where[0][i] != where[2][i] {
			t.Fatalf("prompt %d went to %s, %s and %s from the three replicas, want one engine", i, where[0][i], where[1][i], where[2][i])
		}
	}
}
