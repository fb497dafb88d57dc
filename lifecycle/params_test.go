package lifecycle

import (
	"bytes"
	"testing"
)

// Every path by which the table hands a hold out gives the params that name its blocks with
// it: a release drains or aborts exactly the blocks the prefiller's answer named.
func TestAHoldHandedOutCarriesThePrefillersParams(t *testing.T) {
	for _, tc := range []struct {
		name string
		take func(tb *Table, id string) *Hold
	}{
		{"to the decode", func(tb *Table, id string) *Hold {
			tb.Prefilled(id, testParams)
			_, h, _ := tb.StartDecode(id, "d1")
			return h
		}},
		{"to a client gone while held", func(tb *Table, id string) *Hold {
			tb.Prefilled(id, testParams)
			_, h, _ := tb.ClientGone(id)
			return h
		}},
		{"to a failure while held", func(tb *Table, id string) *Hold {
			tb.Prefilled(id, testParams)
			_, h := tb.Fail(id)
			return h
		}},
		{"to a fresh pair", func(tb *Table, id string) *Hold {
			tb.Prefilled(id, testParams)
			h, _ := tb.Retry(id)
			return h
		}},
		{"to an answer after the client left (R1)", func(tb *Table, id string) *Hold {
			tb.ClientGone(id)
			_, h := tb.Prefilled(id, testParams)
			return h
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			if err := f.tb.Begin("r", "/v1/completions", nil); err != nil {
				t.Fatal(err)
			}
			f.tb.StartPrefill("r", "p1")
			answeredAt := f.clk.Now()
			h := tc.take(f.tb, "r")
			if h == nil {
				t.Fatal("no hold handed out")
			}
			if !bytes.Equal(h.Params(), testParams) {
				t.Errorf("params %s, want the prefiller's %s", h.Params(), testParams)
			}
			if !h.Since().Equal(answeredAt) {
				t.Errorf("held since %v, want the answer's time %v", h.Since(), answeredAt)
			}
			if !h.Release(ReleaseDrained) || f.tb.OutstandingHolds() != 0 {
				t.Errorf("the hold did not end at its one release: %d outstanding", f.tb.OutstandingHolds())
			}
		})
	}
}

// A hold that names nothing has no params: an answer without params holds nothing.
func TestAnAnswerWithoutParamsHoldsNothing(t *testing.T) {
	f := newFixture(t)
	if err := f.tb.Begin("r", "/v1/completions", nil); err != nil {
		t.Fatal(err)
	}
	f.tb.StartPrefill("r", "p1")
	if act, h := f.tb.Prefilled("r", nil); act != None || h != nil {
		t.Fatalf("Prefilled(nil) = %v, %v", act, h)
	}
	if fwd, h, ok := f.tb.StartDecode("r", "d1"); !ok || fwd || h != nil {
		t.Errorf("StartDecode = %v, %v, %v; want a decode with nothing to forward", fwd, h, ok)
	}
	var none *Hold
	if none.Params() != nil || !none.Since().IsZero() {
		t.Error("a nil hold names params or a time")
	}
}

// A hold a release took on is the release's to end: the entry's end does not sweep it, and
// only the first claim counts. An unclaimed hold the entry still names ends with the entry,
// as expired.
func TestAClaimedHoldIsLeftToItsRelease(t *testing.T) {
	for _, claim := range []bool{true, false} {
		f := newFixture(t)
		if err := f.tb.Begin("r", "/v1/completions", nil); err != nil {
			t.Fatal(err)
		}
		f.tb.StartPrefill("r", "p1")
		f.tb.Prefilled("r", testParams)
		_, h, _ := f.tb.ClientGone("r")
		if claim {
			if !h.Claim() || h.Claim() {
				t.Fatal("a hold was claimed twice, or not at all")
			}
		}
		f.tb.End("r")
		if got := h.Released(); got == claim {
			t.Errorf("claimed %v: released by the entry's end %v, want %v", claim, got, !claim)
		}
		if claim {
			if !h.Release(ReleaseDrained) || f.tb.OutstandingHolds() != 0 {
				t.Errorf("the release could not end the claimed hold: %d outstanding", f.tb.OutstandingHolds())
			}
		}
	}
	var none *Hold
	if none.Claim() || none.Claimed() {
		t.Error("a nil hold was claimed")
	}
}
