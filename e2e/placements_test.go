package e2e

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// With shared_state, replicas of cache_aware tell each other where the heads of prompts went:
// every later request of a prompt group reaches the prefiller and the decoder its first
// request went to, through whichever replica, though the others never routed its text; and
// the groups spread over the engines. Replicas of precise_cache_aware tell each other too,
// for the moment before the engines' KV events tell every replica (2 s); after it the
// events keep the group together.
func TestCacheAwareReplicasSendAPromptGroupWhereItFirstWent(t *testing.T) {
	for _, tc := range []struct {
		policy string
		ttl    time.Duration
	}{{routerconfig.PolicyCacheAware, routerconfig.DefaultTreeTTL}, {routerconfig.PolicyPreciseCacheAware, 2 * time.Second}} {
		t.Run(tc.policy, func(t *testing.T) { replicasSendAPromptGroupWhereItFirstWent(t, tc.policy, tc.ttl) })
	}
}

func replicasSendAPromptGroupWhereItFirstWent(t *testing.T, policy string, ttl time.Duration) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), policy, nil)
	// 6 KB: two heads, of 1 and 4 KiB, so that what a head saves outweighs the load a scrape
	// a moment old still shows for the group's previous request.
	preamble := strings.Repeat("You are the group's assistant; answer in one line. ", 120)
	body := func(g, u int) string {
		return fmt.Sprintf(`{"model":"sim","prompt":"group %d: %s question %d","max_tokens":2}`, g, preamble, u)
	}
	// Replica 0 places the groups; the others then see them, in the other order, as new.
	type engines struct{ p, d int }
	first := make([]engines, 6)
	decoders := map[int]int{}
	for g := range first {
		first[g].p, first[g].d = f.send(t, 0, body(g, 0))
		decoders[first[g].d]++
		if g == 0 {
			// A placement is kept for as long as the policy counts it, and no longer.
			var left int64
			testutil.Eventually(t, testutil.Timeout, func() bool {
				reply, _ := srv.Do("EVAL", "local k = redis.call('KEYS', 'pdproxy:head:*')[1] if not k then return -3 end return redis.call('PTTL', k)", "0")
				left = ms(reply)
				return left > 0
			}, "the first group's placements in the shared state")
			if left > ttl.Milliseconds() {
				t.Errorf("a placement expires in %d ms; want within %v", left, ttl)
			}
		}
	}
	if policy == routerconfig.PolicyCacheAware { // precise_cache_aware's may have expired by now
		testutil.Eventually(t, testutil.Timeout, func() bool {
			return headKeys(srv) == 4*len(first) // each group's two heads, for each role
		}, "the groups' placements in the shared state")
	}
	f.settled(t)
	for g := len(first) - 1; g >= 0; g-- {
		for u := 1; u < 4; u++ {
			r := 1 + u%2
			if p, d := f.send(t, r, body(g, u)); p != first[g].p || d != first[g].d {
				t.Errorf("group %d: its first request on p%d/d%d (replica 0), user %d's on p%d/d%d (replica %d)", g, first[g].p, first[g].d, u, p, d, r)
			}
			f.settled(t)
		}
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

// settled waits until every replica's latest scrape shows every engine idle: a scrape taken
// while a request ran shows it running after it ended, and a replica that did not send it
// weighs it as another replica's work there until the next scrape.
func (f *sessionFleet) settled(t *testing.T) {
	t.Helper()
	names := []string{"p0", "p1"}
	for i := range f.decoders {
		names = append(names, fmt.Sprintf("d%d", i))
	}
	for i, r := range f.replicas {
		for _, name := range names {
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				l := viewBackend(t, r.url, name).Load
				return l != nil && l.Waiting == 0 && l.Running == 0, fmt.Sprintf("replica %d to see %s idle: %+v", i, name, l)
			})
		}
	}
}

// With the shared state's Redis gone, cache_aware replicas serve every request on what each
// routed, counting the reads that failed; once it is back they share placements again.
func TestCacheAwareReplicasServeWithoutTheirPlacementsWhileRedisIsDown(t *testing.T) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), routerconfig.PolicyCacheAware, nil)
	preamble := strings.Repeat("An agent's long tool definitions, the same for every run. ", 110) // two heads
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
	// A replica's first calls after the restart may meet connections Redis closed: each such
	// call fails, counted, and a read's pick goes by the replica's own view. Each replica
	// serves new groups until one read and wrote its placements without a failure.
	failures := func(r *stack) float64 {
		return testutil.Value(t, r.m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "placements"}) +
			testutil.Value(t, r.m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "place"})
	}
	warm := 100
	for i, r := range f.replicas {
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
			before := failures(r)
			warm++
			f.send(t, i, body(warm, 0))
			time.Sleep(20 * time.Millisecond) // its placements written, or failed
			up := testutil.Value(t, r.m.Registry, "pdproxy_shared_state_up", nil)
			return failures(r) == before && up == 1, fmt.Sprintf("replica %d using Redis again (%v failures, up %v)", i, failures(r), up)
		})
	}
	before := headKeys(srv)
	p0, d0 := f.send(t, 0, body(9, 0))
	testutil.Eventually(t, testutil.Timeout, func() bool { return headKeys(srv) == before+4 },
		"the new group's placements in the shared state")
	f.settled(t)
	for u := 1; u < 3; u++ {
		if p, d := f.send(t, u, body(9, u)); p != p0 || d != d0 {
			t.Errorf("after Redis came back: the group's first request on p%d/d%d, user %d's on p%d/d%d", p0, d0, u, p, d)
		}
		f.settled(t)
	}
}

// headKeys is how many placements of heads srv holds.
func headKeys(srv *redistest.Server) int {
	n, _ := srv.Do("EVAL", "return #redis.call('KEYS', 'pdproxy:head:*')", "0")
	return int(ms(n))
}

// sentTokens is the sum of the uncached tokens the replicas told srv they sent the engines.
func sentTokens(srv *redistest.Server) int64 {
	n, _ := srv.Do("EVAL", "local n = 0 for _, k in ipairs(redis.call('KEYS', 'pdproxy:sent:*')) do for _, v in ipairs(redis.call('HVALS', k)) do n = n + tonumber(v) end end return n", "0")
	return ms(n)
}

// ms is the number in a Redis integer reply (":123").
func ms(reply string) int64 {
	n, _ := strconv.ParseInt(strings.TrimPrefix(reply, ":"), 10, 64)
	return n
}

// Replicas that share state spread the prompt groups new to the pool by the uncached tokens
// every replica sent each engine lately, not each by its own: groups first sent through the
// three replicas in turn fall as evenly over the prefillers and the decoders as through one.
func TestReplicasSpreadNewGroupsByWhatEveryReplicaSent(t *testing.T) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), routerconfig.PolicyCacheAware, nil)
	preamble := strings.Repeat("Each group's own long instructions, the same for all its users. ", 90)
	prefillers, decoders := map[int]int{}, map[int]int{}
	for g := range 6 {
		before := sentTokens(srv)
		p, d := f.send(t, g%3, fmt.Sprintf(`{"model":"sim","prompt":"group %d: %s","max_tokens":2}`, g, preamble))
		prefillers[p]++
		decoders[d]++
		// What the replica sent is in the shared state before the next group comes.
		testutil.Eventually(t, testutil.Timeout, func() bool { return sentTokens(srv) > before },
			"what the group's picks sent, in the shared state")
		f.settled(t)
	}
	if len(decoders) != 3 || slices.Max(slices.Collect(maps.Values(decoders))) != 2 {
		t.Errorf("6 new groups through 3 replicas in turn went to the decoders %v; want 2 on each of 3", decoders)
	}
	if len(prefillers) != 2 || prefillers[0] != 3 {
		t.Errorf("6 new groups through 3 replicas in turn went to the prefillers %v; want 3 on each of 2", prefillers)
	}
}

// One replica, without shared state, whose engines serve no one else: it spreads the prompt
// groups new to the pool by the uncached tokens it sent each engine lately, as replicas that
// share state do, since no other replica could place a group elsewhere. Its engines' counts
// of the requests they served tell it that it is alone.
func TestAReplicaAloneSpreadsNewGroupsEvenly(t *testing.T) {
	f := startFleet(t, 1, "", routerconfig.PolicyCacheAware, nil)
	engines := []string{"p0", "p1", "d0", "d1", "d2"}
	alone := func(name string) (bool, string) {
		l := viewBackend(t, f.replicas[0].url, name).Load
		return l != nil && l.Alone != nil && *l.Alone, fmt.Sprintf("GET /debug/backends: %s's load %+v; want alone true", name, l)
	}
	for _, name := range engines { // its count read
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) { return alone(name) })
	}
	preamble := strings.Repeat("Each group's own long instructions, the same for all its users. ", 90)
	prefillers, decoders := map[int]int{}, map[int]int{}
	for g := range 6 {
		p, d := f.send(t, 0, fmt.Sprintf(`{"model":"sim","prompt":"group %d: %s","max_tokens":2}`, g, preamble))
		prefillers[p]++
		decoders[d]++
		f.settled(t)
	}
	if len(decoders) != 3 || slices.Max(slices.Collect(maps.Values(decoders))) != 2 {
		t.Errorf("6 new groups through one replica went to the decoders %v; want 2 on each of 3", decoders)
	}
	if len(prefillers) != 2 || prefillers[0] != 3 {
		t.Errorf("6 new groups through one replica went to the prefillers %v; want 3 on each of 2", prefillers)
	}
	for _, name := range engines {
		if ok, why := alone(name); !ok {
			t.Error(why)
		}
	}
}

// Conversations that share a long system prompt, each turn reaching the next replica and no
// session header naming them: with shared state, every replica finds where the conversation's
// previous turn went by the text up to that turn's last message, and sends the next turn
// there, to the prefiller and the decoder that hold its context.
func TestAConversationsTurnsStayTogetherThroughReplicasWithoutASessionHeader(t *testing.T) {
	srv := redistest.Start(t)
	f := startFleet(t, 3, srv.Addr(), routerconfig.PolicyCacheAware, nil)
	system := strings.Repeat("The agent's tools and rules, the same for every conversation. ", 100)
	messages := func(c, turns int) string {
		msgs := []string{fmt.Sprintf(`{"role":"system","content":%q}`, system),
			fmt.Sprintf(`{"role":"user","content":%q}`, fmt.Sprintf("conversation %d: %s", c, strings.Repeat(fmt.Sprintf("a file of its own, %d. ", c), 90)))}
		for k := 1; k < turns; k++ {
			msgs = append(msgs, fmt.Sprintf(`{"role":"assistant","content":"step %d"}`, k), fmt.Sprintf(`{"role":"user","content":"tool output %d of conversation %d"}`, k, c))
		}
		return fmt.Sprintf(`{"model":"sim","max_tokens":2,"messages":[%s]}`, strings.Join(msgs, ","))
	}
	type engines struct{ p, d int }
	first := make([]engines, 4)
	// Each turn's placements are in the shared state before the next turn comes: at least its
	// text up to its last message, in both pools.
	placed := func(before int) {
		testutil.Eventually(t, testutil.Timeout, func() bool { return headKeys(srv) >= before+2 },
			"the turn's placements (its text up to its last message, in both pools) in the shared state")
		f.settled(t)
	}
	for c := range first {
		before := headKeys(srv)
		first[c].p, first[c].d = f.sendTo(t, c%3, "/v1/chat/completions", messages(c, 1))
		placed(before)
	}
	for turn := 2; turn <= 3; turn++ {
		for c := range first {
			r := (c + turn) % 3
			before := headKeys(srv)
			if p, d := f.sendTo(t, r, "/v1/chat/completions", messages(c, turn)); p != first[c].p || d != first[c].d {
				t.Errorf("conversation %d: its first turn on p%d/d%d, turn %d through replica %d on p%d/d%d", c, first[c].p, first[c].d, turn, r, p, d)
			}
			placed(before)
		}
	}
}
