package lifecycle

import (
	"errors"
	"strings"
	"testing"
	"time"
)

const (
	reqID    = "req-1"
	reqRoute = "/v1/chat/completions"
)

// The events of the lifecycle table, as the proxy fires them: one per production transition.
const (
	evBegin           = "begin" // Begin again with the id of the request in the table
	evPrefillStart    = "prefill_start"
	evPrefillRetry    = "prefill_retry"
	evPrefilledKV     = "prefilled_kv"
	evPrefilledNoKV   = "prefilled_no_kv"
	evDecodeOnly      = "decode_only" // the decode-only fallback: to a decoder without a prefill
	evDecodeStart     = "decode_start"
	evDecodeStartLate = "decode_start_late" // StartDecode once the hold deadline has passed
	evFinish          = "finish"
	evFail            = "fail"
	evClientGone      = "client_gone"
	evEnd             = "end"
	evReleaseTwice    = "release_twice" // Release, twice, of the hold the caller owns
	evLegsStart       = "legs_start"    // StartLegs: paired legs (SGLang) go out, the room holds KV
	evLegsJoined      = "legs_joined"   // LegsJoined: the decoder has the room's KV
)

var allEvents = []string{
	evBegin, evPrefillStart, evPrefillRetry, evPrefilledKV, evPrefilledNoKV, evDecodeOnly,
	evDecodeStart, evDecodeStartLate, evFinish, evFail, evClientGone, evEnd, evReleaseTwice,
	evLegsStart, evLegsJoined,
}

// outcome is everything a transition answered.
type outcome struct {
	ok       bool  // Begin without an error, StartPrefill, PrefillRetry, DecodeOnly, Finish, StartDecode's ok, StartLegs, LegsJoined
	err      error // Begin's error
	forward  bool  // StartDecode's forwardKV
	act      Action
	hold     *Hold
	prev     State   // ClientGone's stage
	released [2]bool // the two Release answers of release_twice
}

func fire(f *fixture, event string, owned *Hold) outcome {
	var o outcome
	tb := f.tb
	switch event {
	case evBegin:
		o.err = tb.Begin(reqID, reqRoute, nil)
		o.ok = o.err == nil
	case evPrefillStart:
		o.ok = tb.StartPrefill(reqID, "p2")
	case evPrefillRetry:
		o.ok = tb.PrefillRetry(reqID, "p2")
	case evPrefilledKV:
		o.act, o.hold = tb.Prefilled(reqID, testParams)
	case evPrefilledNoKV:
		o.act, o.hold = tb.Prefilled(reqID, nil)
	case evDecodeOnly:
		o.ok = tb.DecodeOnly(reqID)
	case evDecodeStart:
		o.forward, o.hold, o.ok = tb.StartDecode(reqID, "d2")
	case evDecodeStartLate:
		f.clk.pastDeadline(tb)
		o.forward, o.hold, o.ok = tb.StartDecode(reqID, "d2")
	case evFinish:
		o.ok = tb.Finish(reqID)
	case evFail:
		o.act, o.hold = tb.Fail(reqID)
	case evClientGone:
		o.act, o.hold, o.prev = tb.ClientGone(reqID)
	case evEnd:
		tb.End(reqID)
	case evReleaseTwice:
		o.released[0] = owned.Release(ReleaseDrained)
		o.released[1] = owned.Release(ReleaseDrained)
	case evLegsStart:
		o.ok = tb.StartLegs(reqID, "p2", "d2")
	case evLegsJoined:
		o.ok = tb.LegsJoined(reqID)
	default:
		panic("unknown event " + event)
	}
	return o
}

// row drives a fresh table to one state. It returns the hold the caller owns at that point
// (nil when it owns none) and how many holds are then outstanding.
type row struct {
	name  string
	setup func(t *testing.T, f *fixture) *Hold
	held  int
}

func mustTrue(t *testing.T, what string, ok bool) {
	t.Helper()
	if !ok {
		t.Fatalf("setup: %s answered false", what)
	}
}

func begin(t *testing.T, f *fixture) {
	t.Helper()
	if err := f.tb.Begin(reqID, reqRoute, nil); err != nil {
		t.Fatalf("setup: Begin: %v", err)
	}
}

func toPrefilling(t *testing.T, f *fixture) {
	t.Helper()
	begin(t, f)
	mustTrue(t, "StartPrefill", f.tb.StartPrefill(reqID, "p1"))
}

func toKVHeld(t *testing.T, f *fixture) {
	t.Helper()
	toPrefilling(t, f)
	if act, h := f.tb.Prefilled(reqID, testParams); act != None || h != nil {
		t.Fatalf("setup: Prefilled(true) = %v, %v; want none, nil", act, h)
	}
}

// toDecoding takes the P/D path: the params go to the decoder and the hold to the caller, who
// releases it as decoded once the decoder has the call. It returns that (released) hold.
func toDecoding(t *testing.T, f *fixture) *Hold {
	t.Helper()
	toKVHeld(t, f)
	fwd, h, ok := f.tb.StartDecode(reqID, "d1")
	mustTrue(t, "StartDecode", ok)
	mustTrue(t, "StartDecode forwardKV", fwd)
	if h == nil {
		t.Fatalf("setup: StartDecode forwarded the params but handed no hold over")
	}
	mustTrue(t, "Release", h.Release(ReleaseDecoded))
	return h
}

var rows = []row{
	{name: "received", setup: func(t *testing.T, f *fixture) *Hold { begin(t, f); return nil }},
	{name: "prefilling", setup: func(t *testing.T, f *fixture) *Hold { toPrefilling(t, f); return nil }},
	// legs: paired legs (SGLang) went out together; the table holds the room's hold, with no
	// deadline, until the decoder has the KV.
	{name: "legs", held: 1, setup: func(t *testing.T, f *fixture) *Hold { toLegs(t, f); return nil }},
	{name: "kv_held", held: 1, setup: func(t *testing.T, f *fixture) *Hold { toKVHeld(t, f); return nil }},
	// decoding: the P/D path, the params forwarded; the caller owned the hold and released it
	// as decoded.
	{name: "decoding", setup: func(t *testing.T, f *fixture) *Hold { return toDecoding(t, f) }},
	{name: "finished", setup: func(t *testing.T, f *fixture) *Hold {
		h := toDecoding(t, f)
		mustTrue(t, "Finish", f.tb.Finish(reqID))
		return h
	}},
	// aborted: the client left while the prefill was running; nothing holds KV yet.
	{name: "aborted", setup: func(t *testing.T, f *fixture) *Hold {
		toPrefilling(t, f)
		if act, h, _ := f.tb.ClientGone(reqID); act != CancelPrefill || h != nil {
			t.Fatalf("setup: ClientGone = %v, %v", act, h)
		}
		return nil
	}},
	// aborted_with_kv: the client left in kv_held; the caller owns the hold and has not yet
	// finished releasing it (R2 in progress).
	{name: "aborted_with_kv", held: 1, setup: func(t *testing.T, f *fixture) *Hold {
		toKVHeld(t, f)
		act, h, _ := f.tb.ClientGone(reqID)
		if act != ReleaseKV || h == nil {
			t.Fatalf("setup: ClientGone = %v, %v", act, h)
		}
		return h
	}},
	// failed: the decoder failed after the params went to it.
	{name: "failed", setup: func(t *testing.T, f *fixture) *Hold {
		owned := toDecoding(t, f)
		if act, h := f.tb.Fail(reqID); act != None || h != nil {
			t.Fatalf("setup: Fail = %v, %v", act, h)
		}
		return owned
	}},
	// unknown: an id the table forgot (End came first) is as unknown as one it never saw.
	{name: "unknown", setup: func(t *testing.T, f *fixture) *Hold {
		toKVHeld(t, f)
		f.tb.End(reqID)
		return nil
	}},
}

// expect is what a user of the table sees after one event.
type expect struct {
	ok, forward bool
	act         Action
	hold        bool // a *Hold came back (the caller must release it)
	handedOver  bool // the hold is the caller's alone (StartDecode): Snapshot no longer shows it
	prev        State
	released    [2]bool
	state       State // ignored when gone
	gone        bool  // the table no longer knows the request
	held        int   // pdproxy_kv_held_requests and OutstandingHolds right after the event
	delta       map[string]float64
	check       func(t *testing.T, f *fixture, owned *Hold)
}

type cell struct {
	row, event, behaviour string
	want                  expect
}

func (c cell) name() string { return c.row + "/" + c.event + " " + c.behaviour }

func late(event string) map[string]float64 { return map[string]float64{mLate(event): 1} }
func one(key string) map[string]float64    { return map[string]float64{key: 1} }

func snapshotRow(t *testing.T, f *fixture) Info {
	t.Helper()
	rows := f.tb.Snapshot()
	if len(rows) != 1 {
		t.Fatalf("Snapshot() has %d rows, want 1: %+v", len(rows), rows)
	}
	return rows[0]
}

func wantBackends(prefill, decode string) func(t *testing.T, f *fixture, _ *Hold) {
	return func(t *testing.T, f *fixture, _ *Hold) {
		t.Helper()
		r := snapshotRow(t, f)
		if r.Prefill != prefill || r.Decode != decode {
			t.Errorf("Snapshot backends = %q/%q, want %q/%q", r.Prefill, r.Decode, prefill, decode)
		}
	}
}

var cells = []cell{
	// received
	{"received", evBegin, "again with the id in flight is refused as a duplicate", expect{state: Received}},
	{"received", evPrefillStart, "moves to prefilling", expect{ok: true, state: Prefilling, check: wantBackends("p2", "")}},
	{"received", evPrefillRetry, "before any prefill is refused and counted late", expect{state: Received, delta: late("prefill_retry")}},
	{"received", evPrefilledKV, "before any prefill is a counted no-op", expect{state: Received, delta: late("prefill_done")}},
	{"received", evPrefilledNoKV, "before any prefill is a counted no-op", expect{state: Received, delta: late("prefill_done")}},
	{"received", evDecodeOnly, "goes to a decoder without a prefill and without a hold", expect{ok: true, state: Decoding, check: wantBackends("", "")}},
	{"received", evDecodeStart, "takes the aggregated path without params", expect{ok: true, state: Decoding, check: wantBackends("", "d2")}},
	{"received", evDecodeStartLate, "has no hold and so no deadline: the aggregated decode goes out", expect{ok: true, state: Decoding}},
	{"received", evFinish, "before any decode is refused and counted late", expect{state: Received, delta: late("finish")}},
	{"received", evFail, "ends the request with nothing to release", expect{state: Failed}},
	{"received", evClientGone, "aborts with nothing to cancel", expect{prev: Received, state: Aborted, delta: one(mAborts(Received))}},
	{"received", evEnd, "forgets the request and clears its in-flight count", expect{gone: true}},
	{"received", evReleaseTwice, "has no hold: releasing nil is a harmless false", expect{state: Received}},
	{"received", evLegsStart, "sends paired legs out: the room's hold is recorded at once", expect{ok: true, state: Prefilling, held: 1, check: wantBackends("p2", "d2")}},
	{"received", evLegsJoined, "before any legs went out is refused and counted late", expect{state: Received, delta: late("legs_joined")}},

	// prefilling
	{"prefilling", evBegin, "again with the id in flight is refused as a duplicate", expect{state: Prefilling}},
	{"prefilling", evPrefillStart, "again is refused and counted late", expect{state: Prefilling, delta: late("prefill_start")}},
	{"prefilling", evPrefillRetry, "moves the prefill to another backend", expect{ok: true, state: Prefilling, check: wantBackends("p2", "")}},
	{"prefilling", evPrefilledKV, "with kv holds the KV until the deadline", expect{state: KVHeld, held: 1, check: func(t *testing.T, f *fixture, _ *Hold) {
		if !snapshotRow(t, f).KVHeld {
			t.Errorf("Snapshot kv_held = false, want true")
		}
	}}},
	{"prefilling", evPrefilledNoKV, "without kv goes straight to decoding: P holds nothing, D recomputes", expect{state: Decoding, check: func(t *testing.T, f *fixture, _ *Hold) {
		// No hold, so no deadline: a decode long after still goes out, and nothing expires.
		f.clk.pastDeadline(f.tb)
		before := gather(t, f.reg)
		if fwd, h, ok := f.tb.StartDecode(reqID, "d1"); fwd || h != nil || !ok {
			t.Errorf("StartDecode past the deadline = %v, %v, %v; want false, nil, true", fwd, h, ok)
		}
		assertDeltas(t, before, gather(t, f.reg), nil)
	}}},
	{"prefilling", evDecodeOnly, "falls back to decode-only: P holds nothing, the decoder computes the prompt", expect{ok: true, state: Decoding, check: wantBackends("p1", "")}},
	{"prefilling", evDecodeStart, "before the prefill answered is refused", expect{state: Prefilling, delta: late("decode_start")}},
	{"prefilling", evDecodeStartLate, "before the prefill answered is refused, deadline or not", expect{state: Prefilling, delta: late("decode_start")}},
	{"prefilling", evFinish, "before any decode is refused and counted late", expect{state: Prefilling, delta: late("finish")}},
	{"prefilling", evFail, "ends the request: the prefill failed and P holds nothing", expect{state: Failed}},
	{"prefilling", evClientGone, "cancels the prefill call (R1)", expect{act: CancelPrefill, prev: Prefilling, state: Aborted, delta: one(mAborts(Prefilling))}},
	{"prefilling", evEnd, "forgets the request and clears its in-flight count", expect{gone: true}},
	{"prefilling", evReleaseTwice, "has no hold: releasing nil is a harmless false", expect{state: Prefilling}},
	{"prefilling", evLegsStart, "after the sequential prefill went out is refused and counted late", expect{state: Prefilling, delta: late("legs_start"), check: wantBackends("p1", "")}},
	{"prefilling", evLegsJoined, "on the sequential path, with no room held, is refused and counted late", expect{state: Prefilling, delta: late("legs_joined")}},

	// legs (paired legs out, the room's hold recorded by the table)
	{"legs", evBegin, "again with the id in flight is refused as a duplicate and keeps the hold", expect{state: Prefilling, held: 1}},
	{"legs", evPrefillStart, "is refused and counted late", expect{state: Prefilling, held: 1, delta: late("prefill_start")}},
	{"legs", evPrefillRetry, "is refused and counted late: the room stays on its prefiller", expect{state: Prefilling, held: 1, delta: late("prefill_retry"), check: wantBackends("p1", "d1")}},
	{"legs", evPrefilledKV, "never records a second hold", expect{state: Prefilling, held: 1, delta: late("prefill_done")}},
	{"legs", evPrefilledNoKV, "is a counted no-op that keeps the room's hold", expect{state: Prefilling, held: 1, delta: late("prefill_done")}},
	{"legs", evDecodeOnly, "is refused: the decode leg is out and the room's hold stays", expect{state: Prefilling, held: 1, delta: late("decode_only")}},
	{"legs", evDecodeStart, "is refused: the decode leg is already out", expect{state: Prefilling, held: 1, delta: late("decode_start")}},
	{"legs", evDecodeStartLate, "is refused, deadline or not: the room's hold has none", expect{state: Prefilling, held: 1, delta: late("decode_start")}},
	{"legs", evFinish, "before the legs joined is refused and counted late", expect{state: Prefilling, held: 1, delta: late("finish")}},
	{"legs", evFail, "ends the request and hands the room's hold over for a release", expect{act: ReleaseKV, hold: true, state: Failed, held: 1}},
	{"legs", evClientGone, "cancels the legs and hands the room's hold over for a release", expect{act: CancelPrefill, hold: true, prev: Prefilling, state: Aborted, held: 1, delta: one(mAborts(Prefilling))}},
	{"legs", evEnd, "releases the room's hold nobody took, as expired", expect{gone: true, delta: one(mReleases(ReleaseExpired))}},
	{"legs", evReleaseTwice, "hands no hold out: the table owns the room's until a transition does", expect{state: Prefilling, held: 1}},
	{"legs", evLegsStart, "again is refused and counted late: no second room", expect{state: Prefilling, held: 1, delta: late("legs_start"), check: wantBackends("p1", "d1")}},
	{"legs", evLegsJoined, "moves to decoding and releases the room's hold as decoded", expect{ok: true, state: Decoding, delta: one(mReleases(ReleaseDecoded)), check: wantBackends("p1", "d1")}},

	// kv_held
	{"kv_held", evBegin, "again with the id in flight is refused as a duplicate and keeps the hold", expect{state: KVHeld, held: 1}},
	{"kv_held", evPrefillStart, "is refused and counted late", expect{state: KVHeld, held: 1, delta: late("prefill_start")}},
	{"kv_held", evPrefillRetry, "after the answer is refused and counted late", expect{state: KVHeld, held: 1, delta: late("prefill_retry")}},
	{"kv_held", evPrefilledKV, "again never records a second hold", expect{state: KVHeld, held: 1, delta: late("prefill_done")}},
	{"kv_held", evPrefilledNoKV, "without kv afterwards is a counted no-op that keeps the hold", expect{state: KVHeld, held: 1, delta: late("prefill_done")}},
	{"kv_held", evDecodeOnly, "is refused and counted late: the decode takes the params (StartDecode)", expect{state: KVHeld, held: 1, delta: late("decode_only")}},
	{"kv_held", evDecodeStart, "within the deadline forwards the params and hands the unreleased hold to the caller", expect{ok: true, forward: true, hold: true, handedOver: true, state: Decoding, held: 1, check: wantBackends("p1", "d2")}},
	{"kv_held", evDecodeStartLate, "after the deadline never forwards the params and releases the hold as expired (R4)", expect{ok: true, state: Decoding,
		delta: map[string]float64{mReleases(ReleaseExpired): 1, mDeadlineExceeded: 1}}},
	{"kv_held", evFinish, "before any decode is refused and counted late", expect{state: KVHeld, held: 1, delta: late("finish")}},
	{"kv_held", evFail, "ends the request and asks for a release", expect{act: ReleaseKV, hold: true, state: Failed, held: 1}},
	{"kv_held", evClientGone, "releases the held KV now (R2)", expect{act: ReleaseKV, hold: true, prev: KVHeld, state: Aborted, held: 1, delta: one(mAborts(KVHeld))}},
	{"kv_held", evEnd, "releases the hold nobody took, as expired", expect{gone: true, delta: one(mReleases(ReleaseExpired))}},
	{"kv_held", evReleaseTwice, "hands no hold out: the table owns it until a transition does", expect{state: KVHeld, held: 1}},
	{"kv_held", evLegsStart, "is refused and counted late and keeps the hold", expect{state: KVHeld, held: 1, delta: late("legs_start")}},
	{"kv_held", evLegsJoined, "on the sequential path is refused: the decode takes the params (StartDecode)", expect{state: KVHeld, held: 1, delta: late("legs_joined")}},

	// decoding (P/D: the caller released its hold as decoded)
	{"decoding", evBegin, "again with the id in flight is refused as a duplicate", expect{state: Decoding}},
	{"decoding", evPrefillStart, "is refused and counted late", expect{state: Decoding, delta: late("prefill_start")}},
	{"decoding", evPrefillRetry, "is refused and counted late", expect{state: Decoding, delta: late("prefill_retry")}},
	{"decoding", evPrefilledKV, "a late prefill answer is a counted no-op", expect{state: Decoding, delta: late("prefill_done")}},
	{"decoding", evPrefilledNoKV, "a late prefill answer is a counted no-op", expect{state: Decoding, delta: late("prefill_done")}},
	{"decoding", evDecodeOnly, "once the decode went out is refused and counted late", expect{state: Decoding, delta: late("decode_only")}},
	{"decoding", evDecodeStart, "again records the decoder and never forwards params or hands a hold out", expect{ok: true, state: Decoding, check: wantBackends("p1", "d2")}},
	{"decoding", evDecodeStartLate, "again past the deadline counts nothing: the hold already went to the caller", expect{ok: true, state: Decoding}},
	{"decoding", evFinish, "completes the request", expect{ok: true, state: Finished}},
	{"decoding", evFail, "ends the request with nothing to release: D's notify or P's timer frees P", expect{state: Failed}},
	{"decoding", evClientGone, "cancels the decode call", expect{act: CancelDecode, prev: Decoding, state: Aborted, delta: one(mAborts(Decoding))}},
	{"decoding", evEnd, "forgets the request and clears its in-flight count", expect{gone: true}},
	{"decoding", evReleaseTwice, "the caller's hold was released as decoded: each release again is counted late", expect{state: Decoding, delta: map[string]float64{mLate("release"): 2}}},
	{"decoding", evLegsStart, "is refused and counted late", expect{state: Decoding, delta: late("legs_start")}},
	{"decoding", evLegsJoined, "is refused and counted late", expect{state: Decoding, delta: late("legs_joined")}},

	// finished
	{"finished", evBegin, "before End the id is still taken: refused as a duplicate", expect{state: Finished}},
	{"finished", evPrefillStart, "is a counted no-op", expect{state: Finished, delta: late("prefill_start")}},
	{"finished", evPrefillRetry, "is a counted no-op", expect{state: Finished, delta: late("prefill_retry")}},
	{"finished", evPrefilledKV, "a late prefill answer is a counted no-op", expect{state: Finished, delta: late("prefill_done")}},
	{"finished", evPrefilledNoKV, "a late prefill answer is a counted no-op", expect{state: Finished, delta: late("prefill_done")}},
	{"finished", evDecodeOnly, "is refused and counted late", expect{state: Finished, delta: late("decode_only")}},
	{"finished", evDecodeStart, "is refused and counted late", expect{state: Finished, delta: late("decode_start")}},
	{"finished", evDecodeStartLate, "is refused and counted late", expect{state: Finished, delta: late("decode_start")}},
	{"finished", evFinish, "again is a counted no-op", expect{state: Finished, delta: late("finish")}},
	{"finished", evFail, "is a counted no-op: the request stays finished", expect{state: Finished, delta: late("fail")}},
	{"finished", evClientGone, "is a counted no-op (R5)", expect{prev: Finished, state: Finished, delta: late("client_gone")}},
	{"finished", evEnd, "forgets the request", expect{gone: true}},
	{"finished", evReleaseTwice, "the caller's hold was released as decoded: each release again is counted late", expect{state: Finished, delta: map[string]float64{mLate("release"): 2}}},
	{"finished", evLegsStart, "is refused and counted late", expect{state: Finished, delta: late("legs_start")}},
	{"finished", evLegsJoined, "is refused and counted late", expect{state: Finished, delta: late("legs_joined")}},

	// aborted (while prefilling)
	{"aborted", evBegin, "before End the id is still taken: refused as a duplicate", expect{state: Aborted}},
	{"aborted", evPrefillStart, "after the client left is refused: nothing may be sent", expect{state: Aborted, delta: late("prefill_start")}},
	{"aborted", evPrefillRetry, "after the client left is refused: nothing may be sent", expect{state: Aborted, delta: late("prefill_retry")}},
	{"aborted", evPrefilledKV, "with kv asks for a release (R1)", expect{act: ReleaseKV, hold: true, state: Aborted, held: 1, check: func(t *testing.T, f *fixture, _ *Hold) {
		if !snapshotRow(t, f).KVHeld {
			t.Errorf("Snapshot kv_held = false while the R1 hold is unreleased")
		}
	}}},
	{"aborted", evPrefilledNoKV, "without kv is a counted no-op: P holds nothing", expect{state: Aborted, delta: late("prefill_done")}},
	{"aborted", evDecodeOnly, "after the client left is refused: nothing may be sent", expect{state: Aborted, delta: late("decode_only")}},
	{"aborted", evDecodeStart, "after the client left is refused: nothing may be sent", expect{state: Aborted, delta: late("decode_start")}},
	{"aborted", evDecodeStartLate, "after the client left is refused: nothing may be sent", expect{state: Aborted, delta: late("decode_start")}},
	{"aborted", evFinish, "is a counted no-op", expect{state: Aborted, delta: late("finish")}},
	{"aborted", evFail, "is a counted no-op: the request stays aborted", expect{state: Aborted, delta: late("fail")}},
	{"aborted", evClientGone, "again is a counted no-op (R3)", expect{prev: Aborted, state: Aborted, delta: late("client_gone")}},
	{"aborted", evEnd, "forgets the request", expect{gone: true}},
	{"aborted", evReleaseTwice, "has no hold: releasing nil is a harmless false", expect{state: Aborted}},
	{"aborted", evLegsStart, "is refused and counted late", expect{state: Aborted, delta: late("legs_start")}},
	{"aborted", evLegsJoined, "is refused and counted late", expect{state: Aborted, delta: late("legs_joined")}},

	// aborted_with_kv (the client left in kv_held; the caller still owns the hold)
	{"aborted_with_kv", evBegin, "before End the id is still taken: refused as a duplicate", expect{state: Aborted, held: 1}},
	{"aborted_with_kv", evPrefillStart, "is refused and counted late", expect{state: Aborted, held: 1, delta: late("prefill_start")}},
	{"aborted_with_kv", evPrefillRetry, "is refused and counted late", expect{state: Aborted, held: 1, delta: late("prefill_retry")}},
	{"aborted_with_kv", evPrefilledKV, "again never asks for a second release", expect{state: Aborted, held: 1, delta: late("prefill_done")}},
	{"aborted_with_kv", evPrefilledNoKV, "is a counted no-op that keeps the hold", expect{state: Aborted, held: 1, delta: late("prefill_done")}},
	{"aborted_with_kv", evDecodeOnly, "after the client left is refused: nothing may be sent", expect{state: Aborted, held: 1, delta: late("decode_only")}},
	{"aborted_with_kv", evDecodeStart, "after the client left never forwards the params", expect{state: Aborted, held: 1, delta: late("decode_start")}},
	{"aborted_with_kv", evDecodeStartLate, "after the client left never forwards the params", expect{state: Aborted, held: 1, delta: late("decode_start")}},
	{"aborted_with_kv", evFinish, "is a counted no-op", expect{state: Aborted, held: 1, delta: late("finish")}},
	{"aborted_with_kv", evFail, "never asks for a second release", expect{state: Aborted, held: 1, delta: late("fail")}},
	{"aborted_with_kv", evClientGone, "again never asks for a second release (R3)", expect{prev: Aborted, state: Aborted, held: 1, delta: late("client_gone")}},
	{"aborted_with_kv", evEnd, "releases the hold its owner never released, as expired", expect{gone: true, delta: one(mReleases(ReleaseExpired)), check: func(t *testing.T, f *fixture, owned *Hold) {
		if !owned.Released() {
			t.Fatalf("the owned hold is not released after End")
		}
		before := gather(t, f.reg)
		if owned.Release(ReleaseDrained) {
			t.Errorf("the owner's Release after End answered true: released twice")
		}
		assertDeltas(t, before, gather(t, f.reg), late("release"))
	}}},
	{"aborted_with_kv", evReleaseTwice, "frees the hold once; the second release is counted late", expect{released: [2]bool{true, false}, state: Aborted,
		delta: map[string]float64{mReleases(ReleaseDrained): 1, mLate("release"): 1}, check: func(t *testing.T, f *fixture, _ *Hold) {
			if snapshotRow(t, f).KVHeld {
				t.Errorf("Snapshot kv_held = true after the release")
			}
		}}},
	{"aborted_with_kv", evLegsStart, "is refused and counted late and keeps the hold", expect{state: Aborted, held: 1, delta: late("legs_start")}},
	{"aborted_with_kv", evLegsJoined, "is refused and counted late and keeps the hold", expect{state: Aborted, held: 1, delta: late("legs_joined")}},

	// failed (the decoder failed after the caller released its hold as decoded)
	{"failed", evBegin, "before End the id is still taken: refused as a duplicate", expect{state: Failed}},
	{"failed", evPrefillStart, "is a counted no-op", expect{state: Failed, delta: late("prefill_start")}},
	{"failed", evPrefillRetry, "is a counted no-op", expect{state: Failed, delta: late("prefill_retry")}},
	{"failed", evPrefilledKV, "a late prefill answer is a counted no-op", expect{state: Failed, delta: late("prefill_done")}},
	{"failed", evPrefilledNoKV, "a late prefill answer is a counted no-op", expect{state: Failed, delta: late("prefill_done")}},
	{"failed", evDecodeOnly, "is refused and counted late", expect{state: Failed, delta: late("decode_only")}},
	{"failed", evDecodeStart, "is refused and counted late", expect{state: Failed, delta: late("decode_start")}},
	{"failed", evDecodeStartLate, "is refused and counted late", expect{state: Failed, delta: late("decode_start")}},
	{"failed", evFinish, "is refused: the request stays failed", expect{state: Failed, delta: late("finish")}},
	{"failed", evFail, "again is a counted no-op", expect{state: Failed, delta: late("fail")}},
	{"failed", evClientGone, "is a counted no-op (R5)", expect{prev: Failed, state: Failed, delta: late("client_gone")}},
	{"failed", evEnd, "forgets the request", expect{gone: true}},
	{"failed", evReleaseTwice, "the caller's hold was released as decoded: each release again is counted late", expect{state: Failed, delta: map[string]float64{mLate("release"): 2}}},
	{"failed", evLegsStart, "is refused and counted late", expect{state: Failed, delta: late("legs_start")}},
	{"failed", evLegsJoined, "is refused and counted late", expect{state: Failed, delta: late("legs_joined")}},

	// unknown (already ended)
	{"unknown", evBegin, "once its request ended the id begins a new request", expect{ok: true, state: Received}},
	{"unknown", evPrefillStart, "is refused and counted late", expect{gone: true, delta: late("prefill_start")}},
	{"unknown", evPrefillRetry, "is refused and counted late", expect{gone: true, delta: late("prefill_retry")}},
	{"unknown", evPrefilledKV, "is a counted no-op", expect{gone: true, delta: late("prefill_done")}},
	{"unknown", evPrefilledNoKV, "is a counted no-op", expect{gone: true, delta: late("prefill_done")}},
	{"unknown", evDecodeOnly, "is refused and counted late", expect{gone: true, delta: late("decode_only")}},
	{"unknown", evDecodeStart, "is refused and counted late", expect{gone: true, delta: late("decode_start")}},
	{"unknown", evDecodeStartLate, "is refused and counted late", expect{gone: true, delta: late("decode_start")}},
	{"unknown", evFinish, "is a counted no-op", expect{gone: true, delta: late("finish")}},
	{"unknown", evFail, "is a counted no-op", expect{gone: true, delta: late("fail")}},
	{"unknown", evClientGone, "is a counted no-op that answers aborted", expect{prev: Aborted, gone: true, delta: late("client_gone")}},
	{"unknown", evEnd, "is a no-op", expect{gone: true}},
	{"unknown", evReleaseTwice, "has no hold: releasing nil is a harmless false", expect{gone: true}},
	{"unknown", evLegsStart, "is refused and counted late: nothing may be sent", expect{gone: true, delta: late("legs_start")}},
	{"unknown", evLegsJoined, "is refused and counted late", expect{gone: true, delta: late("legs_joined")}},
}

// TestTransitions drives a fresh table into each state and fires each event once, then checks
// what the caller got back, the state, and the metrics a dashboard shows.
func TestTransitions(t *testing.T) {
	byName := make(map[string]row, len(rows))
	for _, r := range rows {
		byName[r.name] = r
	}
	seen := make(map[string]bool)
	for _, c := range cells {
		key := c.row + "/" + c.event
		if seen[key] {
			t.Fatalf("bad test: two cells for %s", key)
		}
		seen[key] = true
		r, ok := byName[c.row]
		if !ok {
			t.Fatalf("bad test: no row %q", c.row)
		}
		t.Run(c.name(), func(t *testing.T) {
			f := newFixture(t)
			owned := r.setup(t, f)
			before := gather(t, f.reg)
			f.assertGauges(t, before, stateOfRow(t, f), !strings.HasPrefix(r.name, "unknown"), r.held)

			got := fire(f, c.event, owned)
			w := c.want

			if got.ok != w.ok || got.forward != w.forward || got.act != w.act || (got.hold != nil) != w.hold {
				t.Errorf("answer: ok=%v forward=%v action=%v hold=%v; want ok=%v forward=%v action=%v hold=%v",
					got.ok, got.forward, got.act, got.hold != nil, w.ok, w.forward, w.act, w.hold)
			}
			if got.err != nil && !errors.Is(got.err, ErrDuplicate) {
				t.Errorf("Begin = %v, want nil or ErrDuplicate", got.err)
			}
			if c.event == evClientGone && got.prev != w.prev {
				t.Errorf("ClientGone stage = %v, want %v", got.prev, w.prev)
			}
			if got.released != w.released {
				t.Errorf("Release answers = %v, want %v", got.released, w.released)
			}
			st, known := f.tb.State(reqID)
			switch {
			case w.gone && known:
				t.Errorf("State = %v, want the request forgotten", st)
			case !w.gone && !known:
				t.Errorf("State: request forgotten, want %v", w.state)
			case !w.gone && st != w.state:
				t.Errorf("State = %v, want %v", st, w.state)
			}
			if n, want := f.tb.Len(), map[bool]int{true: 0, false: 1}[w.gone]; n != want {
				t.Errorf("Len() = %d, want %d", n, want)
			}
			after := gather(t, f.reg)
			assertDeltas(t, before, after, w.delta)
			f.assertGauges(t, after, st, known, w.held)
			if known {
				if kv := snapshotRow(t, f).KVHeld; kv != (w.held > 0 && !w.handedOver) {
					t.Errorf("Snapshot kv_held = %v with %d holds outstanding (handed over %v)", kv, w.held, w.handedOver)
				}
			}
			if w.check != nil {
				w.check(t, f, owned)
			}

			// A hold that came back is the caller's to release: exactly once.
			if got.hold != nil {
				if got.hold.Released() {
					t.Fatalf("the hold came back already released")
				}
				before := gather(t, f.reg)
				if !got.hold.Release(ReleaseAborted) {
					t.Errorf("first Release = false, want true")
				}
				if got.hold.Release(ReleaseAborted) {
					t.Errorf("second Release = true, want false: released twice")
				}
				after := gather(t, f.reg)
				assertDeltas(t, before, after, map[string]float64{mReleases(ReleaseAborted): 1, mLate("release"): 1})
				f.assertGauges(t, after, st, known, w.held-1)
			}
		})
	}
	for _, r := range rows {
		for _, ev := range allEvents {
			if !seen[r.name+"/"+ev] {
				t.Errorf("bad test: no cell for %s/%s", r.name, ev)
			}
		}
	}
}

func stateOfRow(t *testing.T, f *fixture) State {
	t.Helper()
	st, _ := f.tb.State(reqID)
	return st
}

// Left says how long a hold's params may still go to a decoder, by the table's clock: the
// whole kv_hold_timeout at the prefiller's answer, nothing once its deadline passed (the
// point past which StartDecode no longer forwards them), and nothing for paired legs' holds.
func TestHoldLeftCountsDownToTheHoldDeadline(t *testing.T) {
	f := newFixture(t)
	toKVHeld(t, f)
	_, hold := f.tb.Fail(reqID)
	if hold == nil {
		t.Fatal("setup: Fail left no hold to release")
	}
	if got := hold.Left(); got != testHoldTimeout {
		t.Errorf("Left at the prefiller's answer = %v, want %v", got, testHoldTimeout)
	}
	f.clk.Advance(10 * time.Second)
	if got := hold.Left(); got != testHoldTimeout-10*time.Second {
		t.Errorf("Left 10s later = %v, want %v", got, testHoldTimeout-10*time.Second)
	}
	f.clk.pastDeadline(f.tb)
	if got := hold.Left(); got > 0 {
		t.Errorf("Left past the deadline = %v, want none", got)
	}
	hold.Release(ReleaseDrained)

	g := newFixture(t)
	begin(t, g)
	mustTrue(t, "StartLegs", g.tb.StartLegs(reqID, "p1", "d1"))
	if _, room := g.tb.Fail(reqID); room == nil || room.Left() != 0 {
		t.Errorf("paired legs' hold %v: Left = %v, want 0 (its params never pass through the proxy)", room, room.Left())
	} else {
		room.Release(ReleaseAborted)
	}
}
