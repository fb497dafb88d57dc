package costmodel

import (
	"math"
	"testing"
	"time"
)

func TestTheHorizonIsTheNewestScrapeBeforeThePoolStoredWhatItHadFree(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	type scrape struct{ stored, capacity, free float64 }
	tests := []struct {
		name    string
		scrapes []scrape // one a second from t0
		want    time.Time
		// restartOnly: want is the scrape that found a restart, not a turnover: no period.
		restartOnly bool
	}{
		{"less than a pool stored since the first scrape: nothing is known evicted",
			[]scrape{{0, 1000, 1000}, {400, 1000, 1000}, {999, 1000, 1000}}, time.Time{}, false},
		{"a pool's worth since the first scrape", []scrape{{0, 1000, 1000}, {500, 1000, 1000}, {1000, 1000, 1000}}, at(0), false},
		{"the newest scrape a pool behind, not an older one",
			[]scrape{{0, 1000, 1000}, {500, 1000, 1000}, {1000, 1000, 1000}, {1600, 1000, 1000}}, at(1), false},
		{"an engine that stores nothing keeps its horizon",
			[]scrape{{0, 1000, 1000}, {1200, 1000, 1000}, {1200, 1000, 1000}, {1200, 1000, 1000}}, at(0), false},
		{"a count lower than the last is a restart: its pool was empty, nothing sent before is cached",
			[]scrape{{0, 1000, 1000}, {2000, 1000, 1000}, {3000, 1000, 1000}, {10, 1000, 1000}, {500, 1000, 1000}}, at(3), true},
		{"a restart counts again from its first scrape",
			[]scrape{{0, 1000, 1000}, {5000, 1000, 1000}, {10, 1000, 1000}, {1010, 1000, 1000}}, at(2), false},
		{"another capacity is a restart too", []scrape{{0, 1000, 1000}, {1000, 1000, 1000}, {1000, 4000, 4000}, {3000, 4000, 4000}}, at(2), true},
		{"the first capacity reported is no restart", []scrape{{0, 0, 0}, {0, 1000, 1000}, {500, 1000, 1000}}, time.Time{}, false},
		{"a pool mostly held by running requests turns over in what it has free",
			[]scrape{{0, 1000, 250}, {100, 1000, 250}, {400, 1000, 250}}, at(1), false},
		{"what it has free at the latest scrape", []scrape{{0, 1000, 1000}, {100, 1000, 1000}, {400, 1000, 400}}, at(0), false},
		{"no capacity reported: nothing", []scrape{{0, 1000, 1000}, {1000, 1000, 1000}, {2000, 0, 0}}, time.Time{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var tu Turnover
			for i, s := range tt.scrapes {
				tu.Observe(at(i), s.stored, s.capacity, s.free)
			}
			if got := tu.Horizon(); !got.Equal(tt.want) {
				t.Errorf("Horizon = %v, want %v", got, tt.want)
			}
			wantPeriod := time.Duration(0)
			if !tt.want.IsZero() && !tt.restartOnly {
				wantPeriod = at(len(tt.scrapes) - 1).Sub(tt.want)
			}
			if got := tu.Period(); got != wantPeriod {
				t.Errorf("Period = %v, want %v", got, wantPeriod)
			}
		})
	}
}

func TestTurnoverKeepsABoundedNumberOfSamples(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, step := range []float64{1, 1000, 1e6} { // tokens per scrape, against a pool of 64,000
		var tu Turnover
		for i := range 100_000 {
			tu.Observe(t0.Add(time.Duration(i)*time.Millisecond), float64(i)*step, 64_000, 64_000)
			if n := len(tu.samples); n > maxTurnoverSamples {
				t.Fatalf("%g tokens a scrape: %d samples kept after %d scrapes, want at most %d", step, n, i+1, maxTurnoverSamples)
			}
		}
		// The horizon is the newest scrape a pool behind, to within the spacing of samples.
		last := float64(100_000-1) * step
		h := tu.Horizon()
		behind := last - float64(h.Sub(t0)/time.Millisecond)*step
		if h.IsZero() || behind < 64_000 || behind > 64_000+64_000/turnoverSpacing+step {
			t.Errorf("%g tokens a scrape: horizon %v is %g tokens behind the last count, want a pool's worth (64000) to within a sample", step, h, behind)
		}
	}
}

func TestAtRisk(t *testing.T) {
	now := time.Unix(1000, 0)
	for _, tc := range []struct {
		period time.Duration
		routed time.Time
		want   float64
	}{
		{period: time.Second, routed: now.Add(-4 * time.Second), want: 7500},  // evicts what it holds each second: 3/4 of a 4 s gap
		{period: 4 * time.Second, routed: now.Add(-4 * time.Second), want: 0}, // lasts the gap
		{period: 10 * time.Second, routed: now.Add(-time.Second), want: 0},    // lasts it well
		{period: 0, routed: now.Add(-time.Minute), want: 0},                   // not known
		{period: time.Second, routed: time.Time{}, want: 0},                   // new text: when it comes back is not known
		{period: time.Second, routed: now.Add(time.Second), want: 0},          // a clock step back
		{period: time.Millisecond, routed: now.Add(-time.Second), want: 9990}, // nearly all
	} {
		if got := AtRisk(10_000, tc.period, Gap(tc.routed, now)); math.Abs(got-tc.want) > 1e-6 {
			t.Errorf("AtRisk(10000, period %s, routed %s before) = %v, want %v", tc.period, now.Sub(tc.routed), got, tc.want)
		}
	}
}

func TestKeptOnlyWhereAnEngineWouldKeepThePromptTillItComesBack(t *testing.T) {
	const gap = 2 * time.Second
	for _, tc := range []struct {
		periods []time.Duration
		kept    bool
	}{
		{[]time.Duration{time.Second, 10 * time.Second}, true},    // the second keeps it well
		{[]time.Duration{time.Second, 3 * time.Second}, false},    // lasts the gap, but not with room to spare
		{[]time.Duration{time.Second, 0}, true},                   // one reports no turnover: nothing at risk there
		{[]time.Duration{time.Second, 2 * time.Second}, false},    // lost anywhere
		{[]time.Duration{4 * time.Second, 4 * time.Second}, true}, // twice the gap
		{[]time.Duration{time.Second}, false},                     // one engine, losing it
		{[]time.Duration{}, false},                                // no candidates
	} {
		got := Kept(gap, len(tc.periods), func(i int) time.Duration { return tc.periods[i] })
		if want := map[bool]time.Duration{true: gap}[tc.kept]; got != want {
			t.Errorf("Kept over periods %v, a 2 s gap = %v, want %v", tc.periods, got, want)
		}
	}
	if got := Kept(0, 1, func(int) time.Duration { return time.Second }); got != 0 {
		t.Errorf("Kept of no gap known = %v, want 0", got)
	}
}
