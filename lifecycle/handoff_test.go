package lifecycle

import "testing"

// TestStartDecodeHandsTheHoldOver: within the deadline StartDecode hands the hold to its caller,
// unreleased, and from then on the table never touches it: no later event releases it or asks
// for its release, so only the caller's Release ends it, once. (Past the deadline StartDecode
// releases it as expired and hands nothing over: TestHoldDeadlineBoundary.)
func TestStartDecodeHandsTheHoldOver(t *testing.T) {
	for _, tc := range []struct {
		name string
		// after fires events between the handoff and the caller's release.
		after func(t *testing.T, f *fixture)
		state State // after those events
		gone  bool
		delta map[string]float64 // the counters those events moved
	}{
		{name: "the hold waits for its owner", state: Decoding},
		{name: "fail never releases it nor asks for its release", state: Failed, after: func(t *testing.T, f *fixture) {
			if act, h := f.tb.Fail(reqID); act != None || h != nil {
				t.Errorf("Fail = %v, %v; want none, nil: the caller owns the hold", act, h)
			}
		}},
		{name: "client gone cancels the decode and leaves the hold to its owner", state: Aborted, delta: one(mAborts(Decoding)), after: func(t *testing.T, f *fixture) {
			if act, h, prev := f.tb.ClientGone(reqID); act != CancelDecode || h != nil || prev != Decoding {
				t.Errorf("ClientGone = %v, %v, %v; want cancel_decode, nil, decoding", act, h, prev)
			}
		}},
		{name: "end forgets the request and leaves the hold to its owner", gone: true, after: func(t *testing.T, f *fixture) {
			f.tb.End(reqID)
		}},
		{name: "client gone then end leave the hold to its owner", gone: true, delta: one(mAborts(Decoding)), after: func(t *testing.T, f *fixture) {
			f.tb.ClientGone(reqID)
			f.tb.End(reqID)
		}},
		{name: "fail then end leave the hold to its owner", gone: true, after: func(t *testing.T, f *fixture) {
			f.tb.Fail(reqID)
			f.tb.End(reqID)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			toKVHeld(t, f)
			before := gather(t, f.reg)
			fwd, hold, ok := f.tb.StartDecode(reqID, "d1")
			if !fwd || hold == nil || !ok {
				t.Fatalf("StartDecode = %v, %v, %v; want the params forwarded with a hold", fwd, hold, ok)
			}
			if hold.Released() {
				t.Fatalf("the hold came back already released")
			}
			if tc.after != nil {
				tc.after(t, f)
			}
			st, known := f.tb.State(reqID)
			if known == tc.gone || (known && st != tc.state) {
				t.Errorf("State = %v, %v; want %v, known %v", st, known, tc.state, !tc.gone)
			}
			if hold.Released() {
				t.Fatalf("the hold the caller owns was released by the table")
			}
			after := gather(t, f.reg)
			assertDeltas(t, before, after, tc.delta)
			f.assertGauges(t, after, st, known, 1)

			// The owner's release as decoded counts once; a second is a counted late event.
			before = after
			if !hold.Release(ReleaseDecoded) {
				t.Errorf("the owner's Release = false, want true")
			}
			after = gather(t, f.reg)
			assertDeltas(t, before, after, one(mReleases(ReleaseDecoded)))
			f.assertGauges(t, after, st, known, 0)
			before = after
			if hold.Release(ReleaseDecoded) {
				t.Errorf("second Release = true, want false: released twice")
			}
			after = gather(t, f.reg)
			assertDeltas(t, before, after, late("release"))

			// End once the owner released the hold changes nothing (it was gone already or
			// ends quietly).
			before = after
			f.tb.End(reqID)
			after = gather(t, f.reg)
			assertDeltas(t, before, after, nil)
			f.assertGauges(t, after, st, false, 0)
		})
	}
}

// TestLatePrefillAnswerAfterTheDecodeMakesNoHold: once the decode went out, the prefill's hold
// is settled (handed to the caller with the params, or released as expired past the deadline).
// If the client then leaves, a repeated prefill answer with kv is a counted no-op like any late
// event: only a request aborted while its prefill ran records a hold from it (R1). Otherwise
// the caller would release, as a second hold, KV that a decoder may be pulling.
func TestLatePrefillAnswerAfterTheDecodeMakesNoHold(t *testing.T) {
	for _, tc := range []struct {
		name         string
		pastDeadline bool
	}{
		{"after the params went to the decoder", false},
		{"after the deadline passed and the decode went out without them", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			toKVHeld(t, f)
			if tc.pastDeadline {
				f.clk.pastDeadline(f.tb)
			}
			fwd, hold, ok := f.tb.StartDecode(reqID, "d1")
			if !ok || fwd == tc.pastDeadline || (hold != nil) == tc.pastDeadline {
				t.Fatalf("StartDecode = %v, %v, %v", fwd, hold, ok)
			}
			if hold != nil {
				hold.Release(ReleaseDecoded)
			}
			if act, _, _ := f.tb.ClientGone(reqID); act != CancelDecode {
				t.Fatalf("ClientGone = %v, want cancel_decode", act)
			}
			before := gather(t, f.reg)
			if act, h := f.tb.Prefilled(reqID, testParams); act != None || h != nil {
				t.Errorf("Prefilled(true) = %v, %v; want none, nil: no second hold", act, h)
			}
			after := gather(t, f.reg)
			assertDeltas(t, before, after, late("prefill_done"))
			f.assertGauges(t, after, Aborted, true, 0)
		})
	}
}

// TestEveryHoldCountsByWhoFreesItsBlocks: pdproxy_kv_hold_handoffs_total tells an operator
// which holds the proxy left pinned until the prefiller's lease ends.
func TestEveryHoldCountsByWhoFreesItsBlocks(t *testing.T) {
	for _, tc := range []struct {
		reason ReleaseReason
		result string
	}{
		{ReleaseDecoded, "handed_over"},
		{ReleaseDrained, "released"},
		{ReleaseAborted, "released"},
		{ReleaseExpired, "left_to_engine"},
	} {
		t.Run(string(tc.reason), func(t *testing.T) {
			f := newFixture(t)
			toKVHeld(t, f)
			_, hold, ok := f.tb.StartDecode(reqID, "d1")
			if !ok || hold == nil {
				t.Fatalf("StartDecode gave no hold")
			}
			hold.Release(tc.reason)
			hold.Release(tc.reason) // a second release is a late event, not a second count
			m := gather(t, f.reg)
			for _, result := range []string{"handed_over", "released", "left_to_engine"} {
				want := 0.0
				if result == tc.result {
					want = 1
				}
				if got := m[mHandoffs(result)]; got != want {
					t.Errorf("%s = %v, want %v", mHandoffs(result), got, want)
				}
			}
		})
	}
}
