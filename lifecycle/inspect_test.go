package lifecycle

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

// TestSnapshot checks the /debug/requests view: every request in the table, oldest first,
// with its route, state, backends and whether a prefiller holds KV for it.
func TestSnapshot(t *testing.T) {
	f := newFixture(t)
	tb, clk := f.tb, f.clk
	must := func(what string, ok bool) {
		t.Helper()
		if !ok {
			t.Fatalf("%s answered false", what)
		}
	}
	begin := func(id, route string) {
		t.Helper()
		if err := tb.Begin(id, route, nil); err != nil {
			t.Fatalf("Begin(%s): %v", id, err)
		}
	}
	tick := func() { clk.Advance(time.Second) }
	secs := func(v float64) *float64 { return &v }
	left := func(since float64) *float64 { return secs(testHoldTimeout.Seconds() - since) }

	begin("a", "/v1/completions")
	tick()
	begin("b", "/v1/chat/completions")
	must("StartPrefill", tb.StartPrefill("b", "p1"))
	tick()
	begin("c", "/v1/chat/completions")
	must("StartPrefill", tb.StartPrefill("c", "p1"))
	must("PrefillRetry", tb.PrefillRetry("c", "p2"))
	tb.Prefilled("c", testParams)
	tick()
	begin("d", "/v1/chat/completions")
	must("StartPrefill", tb.StartPrefill("d", "p1"))
	tb.Prefilled("d", testParams)
	_, decodeHold, ok := tb.StartDecode("d", "d1")
	must("StartDecode", ok)
	// The decoder has the call: the caller releases the hold it was handed as decoded.
	must("Release", decodeHold.Release(ReleaseDecoded))
	tick()
	begin("e", "/v1/completions")
	_, _, ok = tb.StartDecode("e", "d2")
	must("StartDecode", ok)
	tick()
	begin("f", "/v1/completions")
	must("StartPrefill", tb.StartPrefill("f", "p1"))
	tb.Prefilled("f", testParams)
	_, hold, _ := tb.ClientGone("f")
	tick()
	begin("g", "/v1/completions")
	_, _, ok = tb.StartDecode("g", "d1")
	must("StartDecode", ok)
	must("Finish", tb.Finish("g"))
	tick()
	begin("h", "/v1/completions")
	tb.End("h")
	tick()

	want := []Info{
		{ID: "a", Route: "/v1/completions", State: Received, AgeSeconds: 8},
		{ID: "b", Route: "/v1/chat/completions", State: Prefilling, AgeSeconds: 7, Prefill: "p1"},
		// A hold shows how long the prefiller has had it and how long its params may still
		// be forwarded.
		{ID: "c", Route: "/v1/chat/completions", State: KVHeld, AgeSeconds: 6, Prefill: "p2", KVHeld: true,
			KVHoldAgeSeconds: secs(6), KVHoldDeadlineInSeconds: left(6)},
		{ID: "d", Route: "/v1/chat/completions", State: Decoding, AgeSeconds: 5, Prefill: "p1", Decode: "d1"},
		{ID: "e", Route: "/v1/completions", State: Decoding, AgeSeconds: 4, Decode: "d2"},
		// The client left in kv_held and the release is still under way: the KV is still held.
		{ID: "f", Route: "/v1/completions", State: Aborted, AgeSeconds: 3, Prefill: "p1", KVHeld: true,
			KVHoldAgeSeconds: secs(3), KVHoldDeadlineInSeconds: left(3)},
		// Ended requests stay listed until End; forgotten ones (h) are not.
		{ID: "g", Route: "/v1/completions", State: Finished, AgeSeconds: 2, Decode: "d1"},
	}
	if got := tb.Snapshot(); !reflect.DeepEqual(got, want) {
		t.Errorf("Snapshot() =\n\t%+v\nwant\n\t%+v", got, want)
	}

	t.Run("json names the state and leaves out unknown backends", func(t *testing.T) {
		got, err := json.Marshal(tb.Snapshot()[:3])
		if err != nil {
			t.Fatal(err)
		}
		want := `[{"id":"a","route":"/v1/completions","state":"received","age_seconds":8,"kv_held":false},` +
			`{"id":"b","route":"/v1/chat/completions","state":"prefilling","age_seconds":7,"prefill":"p1","kv_held":false},` +
			`{"id":"c","route":"/v1/chat/completions","state":"kv_held","age_seconds":6,"prefill":"p2","kv_held":true,` +
			fmt.Sprintf(`"kv_hold_age_seconds":6,"kv_hold_deadline_in_seconds":%v}]`, testHoldTimeout.Seconds()-6)
		if string(got) != want {
			t.Errorf("json:\n\t%s\nwant\n\t%s", got, want)
		}
	})

	t.Run("a released hold no longer shows as held", func(t *testing.T) {
		if !hold.Release(ReleaseDrained) {
			t.Fatal("Release answered false")
		}
		for _, in := range tb.Snapshot() {
			if in.ID == "f" && in.KVHeld {
				t.Errorf("f still shows kv_held after its release")
			}
		}
	})

	t.Run("an empty table is an empty list", func(t *testing.T) {
		for _, id := range []string{"a", "b", "c", "d", "e", "f", "g"} {
			tb.End(id)
		}
		got := tb.Snapshot()
		if got == nil || len(got) != 0 {
			t.Errorf("Snapshot() = %#v, want an empty, non-nil list", got)
		}
		if b, _ := json.Marshal(got); string(b) != "[]" {
			t.Errorf("json = %s, want []", b)
		}
	})
}

// TestAbortAll checks shutdown: AbortAll cancels each request still in flight exactly once,
// leaves ended requests alone, and changes no state itself (each flow then reports ClientGone).
func TestAbortAll(t *testing.T) {
	f := newFixture(t)
	tb := f.tb
	calls := make(map[string]int)
	begin := func(id string) {
		t.Helper()
		if err := tb.Begin(id, "/v1/completions", func() { calls[id]++ }); err != nil {
			t.Fatal(err)
		}
	}
	begin("received")
	begin("prefilling")
	tb.StartPrefill("prefilling", "p1")
	begin("kv_held")
	tb.StartPrefill("kv_held", "p1")
	tb.Prefilled("kv_held", testParams)
	begin("decoding")
	tb.StartDecode("decoding", "d1")
	begin("finished")
	tb.StartDecode("finished", "d1")
	tb.Finish("finished")
	begin("aborted")
	tb.ClientGone("aborted")
	if err := tb.Begin("no_cancel", "/v1/completions", nil); err != nil {
		t.Fatal(err)
	}

	if n := tb.AbortAll(); n != 4 {
		t.Errorf("AbortAll() = %d, want 4", n)
	}
	wantCalls := map[string]int{"received": 1, "prefilling": 1, "kv_held": 1, "decoding": 1}
	if !reflect.DeepEqual(calls, wantCalls) {
		t.Errorf("cancel calls = %v, want %v", calls, wantCalls)
	}
	for id, want := range map[string]State{"received": Received, "prefilling": Prefilling, "kv_held": KVHeld,
		"decoding": Decoding, "finished": Finished, "aborted": Aborted, "no_cancel": Received} {
		if st, _ := tb.State(id); st != want {
			t.Errorf("after AbortAll %s is %v, want %v: AbortAll only cancels", id, st, want)
		}
	}

	// Each flow sees its context done and reports the client gone.
	for id, want := range map[string]Action{"received": None, "prefilling": CancelPrefill, "kv_held": ReleaseKV, "decoding": CancelDecode} {
		act, h, _ := tb.ClientGone(id)
		if act != want {
			t.Errorf("ClientGone(%s) = %v, want %v", id, act, want)
		}
		if h != nil && !h.Release(ReleaseDrained) {
			t.Errorf("release of %s answered false", id)
		}
	}
	if n := tb.AbortAll(); n != 0 {
		t.Errorf("second AbortAll() = %d, want 0: nothing left with a cancel", n)
	}
	if !reflect.DeepEqual(calls, wantCalls) {
		t.Errorf("cancel calls after the second AbortAll = %v, want %v", calls, wantCalls)
	}
	m := gather(t, f.reg)
	// One abort per stage, plus the request that was already aborted in received.
	for s, want := range map[State]float64{Received: 2, Prefilling: 1, KVHeld: 1, Decoding: 1} {
		if m[mAborts(s)] != want {
			t.Errorf("%s = %v, want %v", mAborts(s), m[mAborts(s)], want)
		}
	}
	if tb.OutstandingHolds() != 0 {
		t.Errorf("OutstandingHolds() = %d, want 0", tb.OutstandingHolds())
	}
}

// TestAbortAllCancelsOutsideTheLock: a cancel func may go straight back into the table (the
// flow reporting ClientGone on the same goroutine); AbortAll must not hold the table's lock
// while it calls them, or that deadlocks.
func TestAbortAllCancelsOutsideTheLock(t *testing.T) {
	f := newFixture(t)
	tb := f.tb
	var acts []Action
	for _, id := range []string{"x", "y"} {
		if err := tb.Begin(id, "/v1/completions", func() {
			act, _, _ := tb.ClientGone(id)
			acts = append(acts, act)
			tb.Snapshot()
		}); err != nil {
			t.Fatal(err)
		}
	}
	tb.StartPrefill("y", "p1")
	if n := tb.AbortAll(); n != 2 {
		t.Errorf("AbortAll() = %d, want 2", n)
	}
	if len(acts) != 2 {
		t.Errorf("ClientGone ran %d times from the cancels, want 2", len(acts))
	}
	for _, id := range []string{"x", "y"} {
		if st, _ := tb.State(id); st != Aborted {
			t.Errorf("%s is %v, want aborted", id, st)
		}
	}
}

// TestHoldDeadlineBoundary: the params may go to a decoder up to and including the deadline
// (the prefill's answer plus the hold timeout), never a nanosecond after (R4). Within it the
// hold goes to the caller, who releases it as decoded; past it StartDecode releases it as
// expired and hands nothing over.
func TestHoldDeadlineBoundary(t *testing.T) {
	for _, tc := range []struct {
		name    string
		after   time.Duration
		forward bool
		reason  ReleaseReason
	}{
		{"at the deadline the params still go to the decoder", testHoldTimeout, true, ReleaseDecoded},
		{"a nanosecond after the deadline they never do (R4)", testHoldTimeout + time.Nanosecond, false, ReleaseExpired},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			toKVHeld(t, f)
			f.clk.Advance(tc.after)
			fwd, hold, ok := f.tb.StartDecode(reqID, "d1")
			if !ok || fwd != tc.forward || (hold != nil) != tc.forward {
				t.Errorf("StartDecode = forward %v, hold %v, ok %v; want forward %v, a hold %v, ok true", fwd, hold, ok, tc.forward, tc.forward)
			}
			if hold != nil && !hold.Release(ReleaseDecoded) {
				t.Errorf("the caller's Release of the hold it was handed answered false")
			}
			m := gather(t, f.reg)
			if m[mReleases(tc.reason)] != 1 {
				t.Errorf("%s = %v, want 1", mReleases(tc.reason), m[mReleases(tc.reason)])
			}
			if want := map[bool]float64{true: 0, false: 1}[tc.forward]; m[mDeadlineExceeded] != want {
				t.Errorf("%s = %v, want %v", mDeadlineExceeded, m[mDeadlineExceeded], want)
			}
		})
	}
}

func TestBegin(t *testing.T) {
	t.Run("a second request with an id in flight is refused", func(t *testing.T) {
		f := newFixture(t)
		begin(t, f)
		if err := f.tb.Begin(reqID, reqRoute, nil); !errors.Is(err, ErrDuplicate) {
			t.Errorf("second Begin = %v, want ErrDuplicate", err)
		}
		if f.tb.Len() != 1 {
			t.Errorf("Len() = %d, want 1", f.tb.Len())
		}
		f.assertGauges(t, gather(t, f.reg), Received, true, 0)
	})
	t.Run("an id can be used again once its request ended", func(t *testing.T) {
		f := newFixture(t)
		begin(t, f)
		f.tb.End(reqID)
		if err := f.tb.Begin(reqID, reqRoute, nil); err != nil {
			t.Errorf("Begin after End = %v", err)
		}
		f.assertGauges(t, gather(t, f.reg), Received, true, 0)
	})
	t.Run("a zero hold timeout means 30s", func(t *testing.T) {
		if got := New(Config{}, zaptest.NewLogger(t), nil).KVHoldTimeout(); got != 30*time.Second {
			t.Errorf("KVHoldTimeout() = %v, want 30s", got)
		}
	})
}

func TestNames(t *testing.T) {
	for _, tc := range []struct{ got, want string }{
		{Received.String(), "received"},
		{KVHeld.String(), "kv_held"},
		{Failed.String(), "failed"},
		{State(42).String(), "state(42)"},
		{ReleaseKV.String(), "release_kv"},
		{Action(42).String(), "action(42)"},
	} {
		if tc.got != tc.want {
			t.Errorf("name %q, want %q", tc.got, tc.want)
		}
	}
	if b, err := json.Marshal(map[string]any{"stage": KVHeld, "action": CancelDecode}); err != nil || string(b) != `{"action":"cancel_decode","stage":"kv_held"}` {
		t.Errorf("json of a state and an action = %s, %v; want them by name", b, err)
	}
	for s := Received; s < numStates; s++ {
		if s.Terminal() != (s >= Finished) {
			t.Errorf("%v.Terminal() = %v", s, s.Terminal())
		}
	}
}

// TestSnapshotShowsHowLongEachHoldHasLeft checks the hold timing the live view shows per
// prefiller: the age of each hold and the time left before its params stop being forwarded.
func TestSnapshotShowsHowLongEachHoldHasLeft(t *testing.T) {
	for _, tc := range []struct {
		name         string
		hold         func(tb *Table, id string)
		wait         time.Duration
		wantHeld     bool
		wantDeadline bool
		wantLeft     float64
	}{
		{name: "a prefill's hold counts down from the hold timeout", wait: 10 * time.Second,
			hold: func(tb *Table, id string) {
				tb.StartPrefill(id, "p1")
				tb.Prefilled(id, testParams)
			},
			wantHeld: true, wantDeadline: true, wantLeft: (testHoldTimeout - 10*time.Second).Seconds()},
		{name: "a hold past its deadline shows a negative time left", wait: testHoldTimeout + 5*time.Second,
			hold: func(tb *Table, id string) {
				tb.StartPrefill(id, "p1")
				tb.Prefilled(id, testParams)
			},
			wantHeld: true, wantDeadline: true, wantLeft: -5},
		{name: "paired legs' room has an age and no forwarding deadline", wait: 2 * time.Second,
			hold:     func(tb *Table, id string) { tb.StartLegs(id, "p1", "d1") },
			wantHeld: true},
		{name: "a prefill that answered without params shows no hold", wait: time.Second,
			hold: func(tb *Table, id string) {
				tb.StartPrefill(id, "p1")
				tb.Prefilled(id, nil)
			}},
		{name: "a hold handed to the decode leaves the view", wait: time.Second,
			hold: func(tb *Table, id string) {
				tb.StartPrefill(id, "p1")
				tb.Prefilled(id, testParams)
				tb.StartDecode(id, "d1")
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			if err := f.tb.Begin("r", "/v1/completions", nil); err != nil {
				t.Fatal(err)
			}
			tc.hold(f.tb, "r")
			f.clk.Advance(tc.wait)
			got := f.tb.Snapshot()
			if len(got) != 1 {
				t.Fatalf("Snapshot() = %+v, want one request", got)
			}
			in := got[0]
			if in.KVHeld != tc.wantHeld || (in.KVHoldAgeSeconds != nil) != tc.wantHeld {
				t.Fatalf("kv_held %v, kv_hold_age_seconds %v; want held %v", in.KVHeld, in.KVHoldAgeSeconds, tc.wantHeld)
			}
			if tc.wantHeld && *in.KVHoldAgeSeconds != tc.wait.Seconds() {
				t.Errorf("kv_hold_age_seconds = %v, want %v", *in.KVHoldAgeSeconds, tc.wait.Seconds())
			}
			if (in.KVHoldDeadlineInSeconds != nil) != tc.wantDeadline {
				t.Fatalf("kv_hold_deadline_in_seconds = %v, want present %v", in.KVHoldDeadlineInSeconds, tc.wantDeadline)
			}
			if tc.wantDeadline && *in.KVHoldDeadlineInSeconds != tc.wantLeft {
				t.Errorf("kv_hold_deadline_in_seconds = %v, want %v", *in.KVHoldDeadlineInSeconds, tc.wantLeft)
			}
		})
	}
}
