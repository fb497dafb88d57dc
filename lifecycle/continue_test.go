package lifecycle

import "testing"

// A stream whose decoder died goes on as the same request: another attempt from Received,
// with legs and a hold of its own, and the table still ends it exactly once.
func TestContinueStartsAnotherAttemptOfTheSameRequest(t *testing.T) {
	f := newFixture(t)
	tb := f.tb
	if err := tb.Begin("r", "/v1/completions", func() {}); err != nil {
		t.Fatal(err)
	}
	if !tb.StartPrefill("r", "p0") {
		t.Fatal("StartPrefill refused")
	}
	act, hold := tb.Prefilled("r", testParams)
	if act != None || hold != nil {
		t.Fatalf("Prefilled = %v %v", act, hold)
	}
	fwd, h, ok := tb.StartDecode("r", "d0")
	if !fwd || h == nil || !ok {
		t.Fatalf("StartDecode = %v %v %v", fwd, h, ok)
	}
	h.Release(ReleaseDecoded)

	if !tb.Continue("r") {
		t.Fatal("Continue refused a decoding request")
	}
	if s, _ := tb.State("r"); s != Received {
		t.Fatalf("state after Continue = %v, want received", s)
	}
	info := tb.Snapshot()
	if len(info) != 1 || info[0].Attempts != 1 || info[0].Prefill != "" || info[0].Decode != "" || info[0].KVHeld {
		t.Fatalf("snapshot after Continue = %+v, want one request, attempt 1, no legs, no hold", info)
	}
	// The second attempt prefills again, with its own hold, and decodes elsewhere.
	if !tb.StartPrefill("r", "p1") {
		t.Fatal("second StartPrefill refused")
	}
	if act, _ := tb.Prefilled("r", testParams); act != None {
		t.Fatalf("second Prefilled = %v", act)
	}
	// The client leaving now releases the second attempt's hold.
	act, hold, stage := tb.ClientGone("r")
	if act != ReleaseKV || hold == nil || stage != KVHeld {
		t.Fatalf("ClientGone = %v %v %v, want release_kv of the second hold in kv_held", act, hold, stage)
	}
	hold.Release(ReleaseDrained)
	tb.End("r")
	if n := tb.OutstandingHolds(); n != 0 {
		t.Fatalf("%d holds outstanding, want 0", n)
	}
	if tb.Continue("r") {
		t.Fatal("Continue of an ended request was taken")
	}
}

// Only a decoding request continues: one whose client left, or that is still prefilling, or
// holds KV no decoder acknowledged, is refused, a counted no-op.
func TestContinueRefusesARequestThatIsNotDecoding(t *testing.T) {
	f := newFixture(t)
	tb := f.tb
	for _, id := range []string{"received", "prefilling", "aborted"} {
		if err := tb.Begin(id, "/v1/completions", func() {}); err != nil {
			t.Fatal(err)
		}
	}
	tb.StartPrefill("prefilling", "p0")
	tb.ClientGone("aborted")
	for _, id := range []string{"received", "prefilling", "aborted"} {
		if tb.Continue(id) {
			t.Errorf("Continue(%s) was taken", id)
		}
		tb.End(id)
	}
	if got := gather(t, f.reg)[mLate("continue")]; got != 3 {
		t.Errorf("late continue events = %v, want 3", got)
	}
}

// A pair that failed before the client got anything is tried again as the same request: the
// hold the attempt still had comes back to be released as the attempt's, the next attempt
// starts from Received, and the request's end counts each hold once.
func TestRetryHandsBackTheFailedAttemptsHold(t *testing.T) {
	f := newFixture(t)
	tb := f.tb
	if err := tb.Begin("r", "/v1/completions", func() {}); err != nil {
		t.Fatal(err)
	}
	if _, ok := tb.Retry("r"); ok {
		t.Fatal("Retry took a request that had no legs yet")
	}
	if !tb.StartLegs("r", "p0", "d0") {
		t.Fatal("StartLegs refused")
	}
	hold, ok := tb.Retry("r")
	if !ok || hold == nil || hold.Released() {
		t.Fatalf("Retry of paired legs = %v %v, want the room's hold", hold, ok)
	}
	if n := tb.OutstandingHolds(); n != 1 {
		t.Fatalf("%d holds outstanding after Retry, want the attempt's 1", n)
	}
	info := tb.Snapshot()
	if len(info) != 1 || info[0].State != Received || info[0].Attempts != 1 || info[0].KVHeld {
		t.Fatalf("snapshot after Retry = %+v, want received, attempt 1, no hold", info)
	}
	hold.Release(ReleaseAborted)

	// A sequential attempt whose decode had its hold: nothing to hand back.
	if !tb.StartPrefill("r", "p1") {
		t.Fatal("StartPrefill after Retry refused")
	}
	tb.Prefilled("r", testParams)
	_, h, _ := tb.StartDecode("r", "d1")
	h.Release(ReleaseDecoded)
	if hold, ok := tb.Retry("r"); !ok || hold != nil {
		t.Fatalf("Retry of a decode that had its hold = %v %v, want ok and no hold", hold, ok)
	}
	if act, _, _ := tb.ClientGone("r"); act != None {
		t.Fatalf("ClientGone in Received = %v, want none", act)
	}
	if _, ok := tb.Retry("r"); ok {
		t.Fatal("Retry took a request whose client left")
	}
	tb.End("r")
	if n := tb.OutstandingHolds(); n != 0 {
		t.Fatalf("%d holds outstanding, want 0", n)
	}
}
