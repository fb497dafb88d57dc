package lifecycle

import "testing"

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
			if act, h := f.tb.Prefilled(reqID, tc.kv); act != None || h != nil {
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
