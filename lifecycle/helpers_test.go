package lifecycle

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// The metric series a user sees, by the name the exposition gives them. The tests read them
// from a fresh registry with Gather, the way a scrape would (see gather).
const (
	mHeld             = "pdproxy_kv_held_requests"
	mDeadlineExceeded = "pdproxy_kv_hold_deadline_exceeded_total"
)

func mInflight(s State) string { return fmt.Sprintf(`pdproxy_inflight_requests{state=%q}`, s) }
func mAborts(stage State) string {
	return fmt.Sprintf(`pdproxy_aborts_total{stage=%q}`, stage)
}
func mReleases(r ReleaseReason) string {
	return fmt.Sprintf(`pdproxy_kv_releases_total{reason=%q}`, string(r))
}
func mHandoffs(result string) string {
	return fmt.Sprintf(`pdproxy_kv_hold_handoffs_total{result=%q}`, result)
}
func mLate(event string) string { return fmt.Sprintf(`pdproxy_late_events_total{event=%q}`, event) }

// liveStates are the states with a pdproxy_inflight_requests series.
var liveStates = []State{Received, Prefilling, KVHeld, Decoding}

var allReasons = []ReleaseReason{ReleaseDecoded, ReleaseDrained, ReleaseAborted, ReleaseExpired}

// gather scrapes reg and returns every pdproxy series as `name{label="value",...}` -> value.
func gather(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	return testutil.Snapshot(t, reg, "pdproxy_")
}

// isGauge tells the series whose absolute value a test asserts from the ones it asserts as a delta.
func isGauge(key string) bool {
	return key == mHeld || strings.HasPrefix(key, "pdproxy_inflight_requests{")
}

// clock is an injected Config.Now: it moves only when a test says so.
type clock struct{ *testutil.Clock }

func newClock() *clock {
	return &clock{testutil.NewClock(time.Date(2026, 11, 2, 9, 0, 0, 0, time.UTC))}
}

// pastDeadline moves the clock just past the hold deadline of a hold recorded now.
func (c *clock) pastDeadline(tb *Table) { c.Advance(tb.KVHoldTimeout() + time.Nanosecond) }

// fixture is a table on a fresh registry with an injected clock.
type fixture struct {
	tb  *Table
	reg *prometheus.Registry
	clk *clock
}

const testHoldTimeout = 30 * time.Second

func newFixture(t testing.TB, opts ...zaptest.LoggerOption) *fixture {
	t.Helper()
	f := &fixture{reg: prometheus.NewRegistry(), clk: newClock()}
	var logger *zap.Logger
	if tt, ok := t.(*testing.T); ok {
		logger = zaptest.NewLogger(tt, opts...)
	} else {
		logger = zap.NewNop()
	}
	f.tb = New(Config{KVHoldTimeout: testHoldTimeout, Now: f.clk.Now}, logger, f.reg)
	return f
}

// assertGauges checks what a dashboard shows: one request in `state` (none when it is terminal
// or gone), `held` requests holding KV, and the same number of outstanding holds.
func (f *fixture) assertGauges(t *testing.T, got map[string]float64, state State, known bool, held int) {
	t.Helper()
	for _, s := range liveStates {
		want := 0.0
		if known && s == state {
			want = 1
		}
		if v, ok := got[mInflight(s)]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", mInflight(s), v, ok, want)
		}
	}
	if got[mHeld] != float64(held) {
		t.Errorf("%s = %v, want %d", mHeld, got[mHeld], held)
	}
	if n := f.tb.OutstandingHolds(); n != int64(held) {
		t.Errorf("OutstandingHolds() = %d, want %d", n, held)
	}
}

// assertDeltas checks that every counter moved by exactly want between before and after, and
// that no other counter moved.
func assertDeltas(t *testing.T, before, after map[string]float64, want map[string]float64) {
	t.Helper()
	// Every hold that ends counts once by reason and once by who frees its blocks.
	withHandoffs := make(map[string]float64, len(want)+2)
	for k, v := range want {
		withHandoffs[k] += v
	}
	for _, r := range allReasons {
		if d := want[mReleases(r)]; d != 0 {
			withHandoffs[mHandoffs(r.handoff())] += d
		}
	}
	want = withHandoffs
	keys := make(map[string]bool)
	for k := range before {
		keys[k] = true
	}
	for k := range after {
		keys[k] = true
	}
	for k := range want {
		if isGauge(k) {
			t.Fatalf("bad test: %s is a gauge, assert it absolutely", k)
		}
		if _, ok := after[k]; !ok && want[k] != 0 {
			t.Errorf("series %s missing after the event, want a change of %v", k, want[k])
		}
	}
	for k := range keys {
		if isGauge(k) {
			continue
		}
		if d := after[k] - before[k]; d != want[k] {
			t.Errorf("%s moved by %v, want %v", k, d, want[k])
		}
	}
}

// testParams are a prefiller's KV params, as an answer that holds blocks carries them.
var testParams = []byte(`{"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"p1"}`)

// paramsIf is testParams for an answer that holds KV (kv), nil for one that holds none.
func paramsIf(kv bool) []byte {
	if kv {
		return testParams
	}
	return nil
}
