package lifecycle

import (
	"fmt"
	"testing"

	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

// toLegs sends the request out on paired legs (SGLang): the prefiller holds its KV in a
// bootstrap room from now on, and the table records that hold at once.
func toLegs(t *testing.T, f *fixture) {
	t.Helper()
	begin(t, f)
	mustTrue(t, "StartLegs", f.tb.StartLegs(reqID, "p1", "d1"))
}

// TestPrefillAnswerOnPairedLegsMakesNoHold: a request on paired legs has its room's hold from
// StartLegs, and LegsJoined ends it. A prefill answer (the sequential path's event) is a
// counted late event there: it must neither record a second hold, losing the room's, nor move
// the request on to decoding with the room's hold left in the table, nor, once the legs joined
// and the client left, take a hold for KV the decoder already has (R1 is not this path's race).
func TestPrefillAnswerOnPairedLegsMakesNoHold(t *testing.T) {
	joinedThenGone := func(t *testing.T, f *fixture) {
		toLegs(t, f)
		mustTrue(t, "LegsJoined", f.tb.LegsJoined(reqID))
		if act, h, _ := f.tb.ClientGone(reqID); act != CancelDecode || h != nil {
			t.Fatalf("setup: ClientGone = %v, %v; want cancel_decode, nil", act, h)
		}
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, f *fixture)
		kv    bool
		state State
		held  int
	}{
		{"while the room is held, with kv", toLegs, true, Prefilling, 1},
		{"while the room is held, without kv", toLegs, false, Prefilling, 1},
		{"after the legs joined and the client left, with kv", joinedThenGone, true, Aborted, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tc.setup(t, f)
			before := gather(t, f.reg)
			if act, h := f.tb.Prefilled(reqID, paramsIf(tc.kv)); act != None || h != nil {
				t.Errorf("Prefilled(%v) = %v, %v; want none, nil", tc.kv, act, h)
			}
			after := gather(t, f.reg)
			assertDeltas(t, before, after, late("prefill_done"))
			f.assertGauges(t, after, tc.state, true, tc.held)

			// The room's hold is still the table's, and the only one: End releases it once.
			before = gather(t, f.reg)
			f.tb.End(reqID)
			after = gather(t, f.reg)
			want := map[string]float64{}
			if tc.held > 0 {
				want[mReleases(ReleaseExpired)] = 1
			}
			assertDeltas(t, before, after, want)
			f.assertGauges(t, after, 0, false, 0)
		})
	}
}

// TestDecodeOnlyOnPairedLegsIsLate: the decode-only fallback is the sequential path's way
// round a prefill. On paired legs the decode leg is already out and the prefiller holds the
// room: going to decoding would leave the room's hold in the table where LegsJoined no longer
// ends it and ClientGone no longer hands it over. It is refused, and the legs still join.
func TestDecodeOnlyOnPairedLegsIsLate(t *testing.T) {
	f := newFixture(t)
	toLegs(t, f)
	before := gather(t, f.reg)
	if f.tb.DecodeOnly(reqID) {
		t.Errorf("DecodeOnly = true, want false: the request is on paired legs")
	}
	after := gather(t, f.reg)
	assertDeltas(t, before, after, late("decode_only"))
	f.assertGauges(t, after, Prefilling, true, 1)

	before = gather(t, f.reg)
	if !f.tb.LegsJoined(reqID) {
		t.Fatalf("LegsJoined = false after the refused DecodeOnly")
	}
	after = gather(t, f.reg)
	assertDeltas(t, before, after, one(mReleases(ReleaseDecoded)))
	f.assertGauges(t, after, Decoding, true, 0)
}

// TestPrefillRetryOnPairedLegsIsLate: the room, and so the hold, is on the prefiller the legs
// went to, and the decode leg names it; a retry elsewhere is not a thing paired legs do. The
// inspection view keeps showing where the KV is held.
func TestPrefillRetryOnPairedLegsIsLate(t *testing.T) {
	f := newFixture(t)
	toLegs(t, f)
	before := gather(t, f.reg)
	if f.tb.PrefillRetry(reqID, "p2") {
		t.Errorf("PrefillRetry = true, want false: the request is on paired legs")
	}
	after := gather(t, f.reg)
	assertDeltas(t, before, after, late("prefill_retry"))
	f.assertGauges(t, after, Prefilling, true, 1)
	if r := snapshotRow(t, f); r.Prefill != "p1" || r.Decode != "d1" || !r.KVHeld {
		t.Errorf("Snapshot = %s/%s kv_held %v, want p1/d1 kv_held true: the room is on p1", r.Prefill, r.Decode, r.KVHeld)
	}
}

// TestPairedLegsLife: a request on paired legs from start to end. The room's hold shows from
// the moment the legs go out, ends as decoded (handed over: the decoder has the KV) when they
// join, and nothing is left behind after Finish and End.
func TestPairedLegsLife(t *testing.T) {
	f := newFixture(t)
	start := gather(t, f.reg)
	begin(t, f)
	if !f.tb.StartLegs(reqID, "p1", "d1") {
		t.Fatalf("StartLegs = false in received")
	}
	f.assertGauges(t, gather(t, f.reg), Prefilling, true, 1)
	if r := snapshotRow(t, f); !r.KVHeld || r.Prefill != "p1" || r.Decode != "d1" {
		t.Errorf("Snapshot while the room is held = %+v, want kv_held on p1/d1", r)
	}

	if !f.tb.LegsJoined(reqID) {
		t.Fatalf("LegsJoined = false while the room is held")
	}
	f.assertGauges(t, gather(t, f.reg), Decoding, true, 0)
	if snapshotRow(t, f).KVHeld {
		t.Errorf("Snapshot kv_held = true once the legs joined")
	}
	// The decoder's first byte and the prefiller's answer may both report the join.
	if f.tb.LegsJoined(reqID) {
		t.Errorf("LegsJoined again = true, want false: the hold ended once")
	}

	if !f.tb.Finish(reqID) {
		t.Fatalf("Finish = false in decoding")
	}
	if st, _ := f.tb.State(reqID); st != Finished {
		t.Errorf("State = %v, want finished", st)
	}
	f.tb.End(reqID)
	end := gather(t, f.reg)
	assertDeltas(t, start, end, map[string]float64{mReleases(ReleaseDecoded): 1, mLate("legs_joined"): 1})
	f.assertGauges(t, end, 0, false, 0)
	if n := f.tb.Len(); n != 0 {
		t.Errorf("Len() = %d after End, want 0", n)
	}
}

// TestClientLeavesWhileTheRoomIsHeld: the client leaves before the decoder has the room's KV.
// ClientGone hands the hold to the caller with the cancel (it aborts both legs); the table
// shows it held until the caller releases it, a join reported after that is late, and End
// afterwards finds nothing left to release.
func TestClientLeavesWhileTheRoomIsHeld(t *testing.T) {
	f := newFixture(t)
	toLegs(t, f)
	before := gather(t, f.reg)
	act, hold, prev := f.tb.ClientGone(reqID)
	if act != CancelPrefill || hold == nil || prev != Prefilling {
		t.Fatalf("ClientGone = %v, %v, %v; want cancel_prefill with the hold, from prefilling", act, hold, prev)
	}
	after := gather(t, f.reg)
	assertDeltas(t, before, after, one(mAborts(Prefilling)))
	f.assertGauges(t, after, Aborted, true, 1)
	if !snapshotRow(t, f).KVHeld {
		t.Errorf("Snapshot kv_held = false before the caller released the room's hold")
	}

	// The decoder's answer racing the abort: the hold is the caller's now.
	before = gather(t, f.reg)
	if f.tb.LegsJoined(reqID) {
		t.Errorf("LegsJoined after ClientGone = true, want false")
	}
	assertDeltas(t, before, gather(t, f.reg), late("legs_joined"))

	before = gather(t, f.reg)
	if !hold.Release(ReleaseAborted) {
		t.Fatalf("the caller's Release = false: someone released the room's hold before its owner")
	}
	after = gather(t, f.reg)
	assertDeltas(t, before, after, one(mReleases(ReleaseAborted)))
	f.assertGauges(t, after, Aborted, true, 0)
	if snapshotRow(t, f).KVHeld {
		t.Errorf("Snapshot kv_held = true after the release")
	}

	before = gather(t, f.reg)
	f.tb.End(reqID)
	after = gather(t, f.reg)
	assertDeltas(t, before, after, nil)
	f.assertGauges(t, after, 0, false, 0)
}

// TestLegsJoinedRacingClientGone: the decoder's first byte and the client leaving at the same
// moment. Exactly one of them takes the room's hold: either the join releases it as decoded
// and ClientGone cancels the decode with no hold, or ClientGone hands it over with the cancel
// and the join is late. Never both, never neither.
func TestLegsJoinedRacingClientGone(t *testing.T) {
	f := newFixture(t, zaptest.Level(zapcore.InfoLevel))
	tb := f.tb
	joined := 0
	for i := range raceRounds {
		id := fmt.Sprintf("req-%d", i)
		if err := tb.Begin(id, reqRoute, nil); err != nil {
			t.Fatal(err)
		}
		if !tb.StartLegs(id, "p1", "d1") {
			t.Fatalf("round %d: StartLegs = false", i)
		}
		var (
			ok   bool
			act  Action
			hold *Hold
			prev State
		)
		together(func() { ok = tb.LegsJoined(id) }, func() { act, hold, prev = tb.ClientGone(id) })
		switch {
		case ok && act == CancelDecode && hold == nil && prev == Decoding:
			joined++
		case !ok && act == CancelPrefill && hold != nil && prev == Prefilling:
			if !hold.Release(ReleaseAborted) {
				t.Fatalf("round %d: ClientGone handed over a hold that was already released", i)
			}
		default:
			t.Fatalf("round %d: LegsJoined = %v, ClientGone = %v, hold %v, from %v: exactly one must take the room's hold",
				i, ok, act, hold != nil, prev)
		}
		tb.End(id)
	}
	t.Logf("%d of %d rounds joined first", joined, raceRounds)
	m := gather(t, f.reg)
	gone := float64(raceRounds - joined)
	for key, want := range map[string]float64{
		mReleases(ReleaseDecoded): float64(joined),
		mReleases(ReleaseAborted): gone,
		mReleases(ReleaseExpired): 0,
		mAborts(Decoding):         float64(joined),
		mAborts(Prefilling):       gone,
		mLate("legs_joined"):      gone,
		mLate("release"):          0,
	} {
		if m[key] != want {
			t.Errorf("%s = %v, want %v", key, m[key], want)
		}
	}
	f.assertGauges(t, m, 0, false, 0)
}
