package e2e

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// With shared_state, replicas of cache_aware tell each other where the heads of prompts went:
// a client alternating replicas gets every request of a prompt group on the prefiller and the
// decoder its first request went to, though the other replicas never routed its text, and the
// groups spread over the engines.
func TestCacheAwareReplicasSendAPromptGroupWhereItFirstWent(t *testing.T) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), routerconfig.PolicyCacheAware, nil)
	preamble := strings.Repeat("You are the group's assistant; answer in one line. ", 40) // one head of 1 KiB
	decoders := map[int]int{}
	for g := range 6 {
		body := func(u int) string {
			return fmt.Sprintf(`{"model":"sim","prompt":"group %d: %s question %d","max_tokens":2}`, g, preamble, u)
		}
		p0, d0 := f.send(t, g%3, body(0))
		testutil.Eventually(t, testutil.Timeout, func() bool {
			n, _ := srv.Do("DBSIZE")
			return n == fmt.Sprintf(":%d", 2*(g+1)) // the group's head, for each role
		}, "group %d's placements in the shared state", g)
		for u := 1; u < 4; u++ {
			if p, d := f.send(t, (g+u)%3, body(u)); p != p0 || d != d0 {
				t.Errorf("group %d: its first request on p%d/d%d (replica %d), user %d's on p%d/d%d (replica %d)", g, p0, d0, g%3, u, p, d, (g+u)%3)
			}
		}
		decoders[d0]++
	}
	if len(decoders) < 3 {
		t.Errorf("6 groups went to %d of 3 decoders: %v", len(decoders), decoders)
	}
	for i, r := range f.replicas {
		if v := testutil.Value(t, r.m.Registry, "pdproxy_shared_state_errors_total", nil); v != 0 {
			t.Errorf("replica %d counted %v shared state errors", i, v)
		}
	}
}

// With the shared state's Redis gone, cache_aware replicas serve every request on what each
// routed, counting the reads that failed; once it is back they share placements again.
func TestCacheAwareReplicasServeWithoutTheirPlacementsWhileRedisIsDown(t *testing.T) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), routerconfig.PolicyCacheAware, nil)
	preamble := strings.Repeat("An agent's long tool definitions, the same for every run. ", 40)
	body := func(g, u int) string {
		return fmt.Sprintf(`{"model":"sim","prompt":"group %d: %s question %d","max_tokens":2}`, g, preamble, u)
	}
	srv.Stop()
	for g := range 3 {
		for u := range 3 {
			f.send(t, (g+u)%3, body(g, u)) // fails the test on any answer but a 200
		}
	}
	failed := 0.0
	for _, r := range f.replicas {
		failed += testutil.Value(t, r.m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "placements"})
	}
	if failed == 0 {
		t.Error("no failed placement read counted with Redis stopped")
	}
	srv.Restart()
	for i, r := range f.replicas {
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
			v := testutil.Value(t, r.m.Registry, "pdproxy_shared_state_up", nil)
			return v == 1, fmt.Sprintf("replica %d: pdproxy_shared_state_up = %v after Redis came back", i, v)
		})
	}
	p0, d0 := f.send(t, 0, body(9, 0))
	testutil.Eventually(t, testutil.Timeout, func() bool { n, _ := srv.Do("DBSIZE"); return n == ":2" },
		"the new group's placements in the shared state")
	for u := 1; u < 3; u++ {
		if p, d := f.send(t, u, body(9, u)); p != p0 || d != d0 {
			t.Errorf("after Redis came back: the group's first request on p%d/d%d, user %d's on p%d/d%d", p0, d0, u, p, d)
		}
	}
}
