package lifecycle

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

// Rounds of the two-goroutine races below: enough for the scheduler to land one event inside
// the other many times over, on a busy two-core machine too.
const raceRounds = 2000

// endRaceRounds is larger: the window it probes (between End seeing a hold unreleased and
// releasing it) is a few instructions wide.
const endRaceRounds = 10000

// together runs a and b at once, released by the same close.
func together(a, b func()) {
	var wg sync.WaitGroup
	start := make(chan struct{})
	wg.Go(func() { <-start; a() })
	wg.Go(func() { <-start; b() })
	close(start)
	wg.Wait()
}

// TestDecodeStartRacingFail: the decode going out and a failure reported at the same moment.
// The KV goes either to the decoder (its hold to StartDecode's caller) or to exactly one
// release that Fail asks for, never to both.
func TestDecodeStartRacingFail(t *testing.T) {
	f := newFixture(t, zaptest.Level(zapcore.InfoLevel))
	tb := f.tb
	forwarded, releaseFalse := 0, 0
	for i := range raceRounds {
		id := fmt.Sprintf("req-%d", i)
		if err := tb.Begin(id, reqRoute, nil); err != nil {
			t.Fatal(err)
		}
		tb.StartPrefill(id, "p1")
		tb.Prefilled(id, testParams)
		var (
			fwd, ok          bool
			act              Action
			hold, decodeHold *Hold
		)
		together(func() { fwd, decodeHold, ok = tb.StartDecode(id, "d1") }, func() { act, hold = tb.Fail(id) })
		if fwd && act == ReleaseKV {
			t.Fatalf("round %d: the params went to the decoder and Fail asked for a release too", i)
		}
		if ok == (act == ReleaseKV) {
			t.Fatalf("round %d: StartDecode ok=%v and Fail answered %v: exactly one must take the hold", i, ok, act)
		}
		if (decodeHold != nil) != fwd || (decodeHold != nil && decodeHold == hold) {
			t.Fatalf("round %d: StartDecode forward=%v handed over %p, Fail %p: the hold goes with the params, to one owner", i, fwd, decodeHold, hold)
		}
		if fwd {
			forwarded++
			if !decodeHold.Release(ReleaseDecoded) {
				t.Fatalf("round %d: the decoder's hold was already released", i)
			}
		}
		if hold != nil && !hold.Release(ReleaseAborted) {
			releaseFalse++
		}
		tb.End(id)
	}
	m := gather(t, f.reg)
	if m[mReleases(ReleaseDecoded)] != float64(forwarded) {
		t.Errorf("%s = %v, want %d", mReleases(ReleaseDecoded), m[mReleases(ReleaseDecoded)], forwarded)
	}
	if releaseFalse != 0 || m[mLate("release")] != 0 {
		t.Errorf("%d releases after Fail answered false, %s = %v; want 0, 0", releaseFalse, mLate("release"), m[mLate("release")])
	}
	if tb.OutstandingHolds() != 0 || m[mHeld] != 0 {
		t.Errorf("OutstandingHolds() = %d, %s = %v; want 0", tb.OutstandingHolds(), mHeld, m[mHeld])
	}
	t.Logf("%d of %d decodes won the race", forwarded, raceRounds)
}

// TestEndRacingRelease: the owner releasing a hold while End sweeps the request. One of them
// releases it; late_events_total{event="release"} counts only an owner's release that lost.
func TestEndRacingRelease(t *testing.T) {
	f := newFixture(t, zaptest.Level(zapcore.InfoLevel))
	tb := f.tb
	ownerLost := 0
	for i := range endRaceRounds {
		id := fmt.Sprintf("req-%d", i)
		if err := tb.Begin(id, reqRoute, nil); err != nil {
			t.Fatal(err)
		}
		tb.StartPrefill(id, "p1")
		tb.Prefilled(id, testParams)
		_, hold, _ := tb.ClientGone(id)
		var won bool
		together(func() { tb.End(id) }, func() { won = hold.Release(ReleaseDrained) })
		if !won {
			ownerLost++
		}
	}
	m := gather(t, f.reg)
	if got := m[mLate("release")]; got != float64(ownerLost) {
		t.Errorf("%s = %v, want %d (the owner's releases that lost to End)", mLate("release"), got, ownerLost)
	}
	if got, want := m[mReleases(ReleaseDrained)]+m[mReleases(ReleaseExpired)], float64(endRaceRounds); got != want {
		t.Errorf("releases drained+expired = %v, want %v: each hold released once", got, want)
	}
	if tb.OutstandingHolds() != 0 {
		t.Errorf("OutstandingHolds() = %d, want 0", tb.OutstandingHolds())
	}
	t.Logf("End released %d of %d holds first", ownerLost, endRaceRounds)
}

// TestReleaseFromManyGoroutines: one hold, many releases at once: exactly one answers true.
func TestReleaseFromManyGoroutines(t *testing.T) {
	f := newFixture(t, zaptest.Level(zapcore.InfoLevel))
	toKVHeld(t, f)
	_, hold, _ := f.tb.ClientGone(reqID)
	const n = 64
	var wins atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			if hold.Release(ReleaseDrained) {
				wins.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	m := gather(t, f.reg)
	if wins.Load() != 1 || m[mReleases(ReleaseDrained)] != 1 || m[mLate("release")] != n-1 || m[mHeld] != 0 {
		t.Errorf("wins %d, %s %v, %s %v, %s %v; want 1, 1, %d, 0", wins.Load(),
			mReleases(ReleaseDrained), m[mReleases(ReleaseDrained)], mLate("release"), m[mLate("release")], mHeld, m[mHeld], n-1)
	}
}
