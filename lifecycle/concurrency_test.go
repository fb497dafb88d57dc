package lifecycle

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

var seedFlag = flag.Uint64("lifecycle.seed", 0, "seed of TestConcurrentRequests; 0 picks a new one")

// path is the way one simulated request goes through the proxy.
type path int

const (
	pathPD                     path = iota // prefill with kv, decode with the params, finish
	pathAggregated                         // no prefill: decode, finish
	pathNoKV                               // P answers without params: D recomputes
	pathDecodeOnly                         // the decode-only fallback, before or during the prefill
	pathClientGone                         // the client leaves after a random step
	pathPrefillAfterGone                   // the client leaves, then P answers with kv (R1)
	pathDeadlineDecode                     // the hold deadline passes, then the decode goes out (R4)
	pathDeadlineFail                       // the deadline passes, the decode goes out without params, D fails
	pathFail                               // P or D fails at a random step
	pathDouble                             // every event fired twice
	pathLateAfterEnd                       // the P/D path, then every event again after End
	pathEndBeforeRelease                   // client gone in kv_held; End runs before the release is done
	pathEndBeforeDecodeRelease             // the decode got the hold; End runs before its owner releases it
	pathEndMidway                          // End while still in flight (a recovered panic)
	numPaths
)

var pathNames = [numPaths]string{"pd", "aggregated", "no_kv", "decode_only", "client_gone", "prefill_after_gone",
	"deadline_decode", "deadline_fail", "fail", "double", "late_after_end", "end_before_release",
	"end_before_decode_release", "end_midway"}

// releasesAfterEnd: the flow releases the holds it owns only after End, which may have released
// a hold it got from a ReleaseKV answer first.
func (p path) releasesAfterEnd() bool {
	return p == pathEndBeforeRelease || p == pathEndBeforeDecodeRelease
}

// answer is one event on one request and what the table answered.
type answer struct {
	event    string
	by       string // driver or chaos
	afterEnd bool   // fired after the driver's End returned
	ok, fwd  bool
	act      Action
	hold     *Hold
	prev     State
}

func (a answer) String() string {
	s := fmt.Sprintf("%s(%s) ok=%v fwd=%v act=%v hold=%v", a.event, a.by, a.ok, a.fwd, a.act, a.hold != nil)
	if a.event == "client_gone" {
		s += " prev=" + a.prev.String()
	}
	if a.afterEnd {
		s += " after_end"
	}
	return s
}

// rec is one request of the run and everything that happened to it.
type rec struct {
	id         string
	path       path
	step       int  // where pathClientGone / pathFail leave the happy path; pathDecodeOnly: 1 after StartPrefill
	chaos      bool // chaos goroutines fire ClientGone at it
	abortAfter bool // AbortAll is fired when this request ends

	cancel   context.CancelFunc
	abortAll atomic.Int64 // calls of the cancel func given to Begin

	// gate orders chaos events against End: a chaos event holds it for reading, End for
	// writing, so each answer knows whether it came before or after End.
	gate  sync.RWMutex
	begun bool
	ended bool

	mu               sync.Mutex
	answers          []answer
	stateAtEnd       State
	knownAtEnd       bool
	holdsCreated     int  // holds the prefiller took for this request, as the answers show
	kvHeld           bool // the first prefill answer with kv moved it to kv_held
	decodeSent       bool
	deadlineExceeded int // decodes that left kv_held without the params
}

func (r *rec) record(a answer) {
	r.mu.Lock()
	r.answers = append(r.answers, a)
	r.mu.Unlock()
}

// world is the shared state of one run.
type world struct {
	t   *testing.T
	f   *fixture
	rec []*rec

	holdsMu      sync.Mutex
	pool         []*Hold       // every hold handed out, for chaos releases
	wins         map[*Hold]int // Release calls that answered true, per hold
	releaseFalse int           // Release calls that answered false

	abortAllCancels atomic.Int64
	abortAllCh      chan struct{}
	done            atomic.Bool
}

func (w *world) adopt(h *Hold) {
	w.holdsMu.Lock()
	w.pool = append(w.pool, h)
	w.holdsMu.Unlock()
}

func (w *world) release(h *Hold, reason ReleaseReason) bool {
	ok := h.Release(reason)
	w.holdsMu.Lock()
	if ok {
		w.wins[h]++
	} else {
		w.releaseFalse++
	}
	w.holdsMu.Unlock()
	return ok
}

// driver plays one request's own flow, as the proxy's handler would.
type driver struct {
	w       *world
	r       *rec
	ctx     context.Context
	pending []owned // holds this flow owns and has not released yet
	twice   bool
}

func (d *driver) tb() *Table { return d.w.f.tb }

type owned struct {
	hold   *Hold
	reason ReleaseReason // how the flow frees it: a drain, an abort, the engine's timer
}

// take adopts the hold an answer handed out: the flow now owns its release.
func (d *driver) take(act Action, h *Hold, reason ReleaseReason) {
	if act == ReleaseKV && h != nil {
		d.w.adopt(h)
		d.pending = append(d.pending, owned{h, reason})
	}
}

func (d *driver) releasePending() {
	for _, o := range d.pending {
		d.w.release(o.hold, o.reason)
		if d.twice {
			d.w.release(o.hold, o.reason)
		}
	}
	d.pending = nil
}

// cancelled is the flow noticing its context is done (AbortAll or a chaos disconnect): it
// reports the client gone and stops.
func (d *driver) cancelled() bool {
	if d.ctx.Err() == nil {
		return false
	}
	d.clientGone()
	return true
}

func (d *driver) startPrefill() bool {
	ok := d.tb().StartPrefill(d.r.id, "p1")
	d.r.record(answer{event: "prefill_start", by: "driver", ok: ok})
	return ok
}

func (d *driver) prefilled(kv bool) bool {
	act, h := d.tb().Prefilled(d.r.id, paramsIf(kv))
	d.r.mu.Lock()
	first := !d.r.kvHeld && d.r.holdsCreated == 0
	if act == ReleaseKV {
		d.r.holdsCreated++
	} else if kv && first && act == None {
		// The first answer with kv in prefilling makes the table's own hold.
		d.r.holdsCreated++
		d.r.kvHeld = true
	}
	d.r.answers = append(d.r.answers, answer{event: "prefilled", by: "driver", act: act, hold: h})
	d.r.mu.Unlock()
	d.take(act, h, ReleaseAborted)
	return act == None
}

func (d *driver) decodeOnly() bool {
	ok := d.tb().DecodeOnly(d.r.id)
	d.r.record(answer{event: "decode_only", by: "driver", ok: ok})
	return ok
}

func (d *driver) startDecode() bool {
	fwd, h, ok := d.tb().StartDecode(d.r.id, "d1")
	d.r.mu.Lock()
	if ok && d.r.kvHeld && !d.r.decodeSent && !fwd {
		d.r.deadlineExceeded++
	}
	if ok {
		d.r.decodeSent = true
	}
	d.r.answers = append(d.r.answers, answer{event: "decode_start", by: "driver", ok: ok, fwd: fwd, hold: h})
	d.r.mu.Unlock()
	if h != nil {
		// The hold went with the params and is this flow's now: it releases it as decoded
		// once the decoder has the call. Only the flow has it, so no chaos release races it.
		d.pending = append(d.pending, owned{h, ReleaseDecoded})
	}
	return ok
}

func (d *driver) finish() bool {
	ok := d.tb().Finish(d.r.id)
	d.r.record(answer{event: "finish", by: "driver", ok: ok})
	return ok
}

func (d *driver) fail() {
	act, h := d.tb().Fail(d.r.id)
	d.r.record(answer{event: "fail", by: "driver", act: act, hold: h})
	d.take(act, h, ReleaseAborted)
}

func (d *driver) clientGone() {
	act, h, prev := d.tb().ClientGone(d.r.id)
	d.r.record(answer{event: "client_gone", by: "driver", act: act, hold: h, prev: prev})
	d.take(act, h, ReleaseDrained)
}

func (d *driver) end() {
	r := d.r
	r.gate.Lock()
	st, known := d.tb().State(r.id)
	d.tb().End(r.id)
	r.ended = true
	r.gate.Unlock()
	r.mu.Lock()
	r.stateAtEnd, r.knownAtEnd = st, known
	r.mu.Unlock()
}

// lateAfterEnd fires every event at a request the table has forgotten.
func (d *driver) lateAfterEnd() {
	tb, id := d.tb(), d.r.id
	note := func(a answer) { a.by, a.afterEnd = "driver", true; d.r.record(a) }
	note(answer{event: "prefill_start", ok: tb.StartPrefill(id, "p1")})
	note(answer{event: "prefill_retry", ok: tb.PrefillRetry(id, "p2")})
	act, h := tb.Prefilled(id, testParams)
	note(answer{event: "prefilled", act: act, hold: h})
	note(answer{event: "decode_only", ok: tb.DecodeOnly(id)})
	fwd, h, ok := tb.StartDecode(id, "d1")
	note(answer{event: "decode_start", ok: ok, fwd: fwd, hold: h})
	note(answer{event: "finish", ok: tb.Finish(id)})
	act, h = tb.Fail(id)
	note(answer{event: "fail", act: act, hold: h})
	act, h, prev := tb.ClientGone(id)
	note(answer{event: "client_gone", act: act, hold: h, prev: prev})
	tb.End(id)
}

// seq runs steps in order until one says stop; before each step the flow checks its context.
// Each step yields first, as a flow waiting on a backend would, so that many requests are in
// the table at once and the other goroutines' events land between the steps.
func (d *driver) seq(steps ...func() bool) {
	for _, s := range steps {
		runtime.Gosched()
		if d.cancelled() || !s() {
			return
		}
	}
}

func (d *driver) run() {
	r, w := d.r, d.w
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.ctx = ctx
	r.cancel = cancel
	r.gate.Lock()
	if err := w.f.tb.Begin(r.id, "/v1/completions", func() { r.abortAll.Add(1); cancel() }); err != nil {
		w.t.Errorf("Begin(%s): %v", r.id, err)
	}
	r.begun = true
	r.gate.Unlock()

	pf := func(kv bool) func() bool { return func() bool { return d.prefilled(kv) } }
	gone := func() bool { d.clientGone(); return false }
	pastDeadline := func() bool { w.f.clk.pastDeadline(w.f.tb); return true }
	failNow := func() bool { d.fail(); return false }
	releaseLate := false

	switch r.path {
	case pathPD, pathLateAfterEnd:
		d.seq(d.startPrefill, pf(true), d.startDecode, d.finish)
	case pathAggregated:
		d.seq(d.startDecode, d.finish)
	case pathNoKV:
		d.seq(d.startPrefill, pf(false), d.startDecode, d.finish)
	case pathDecodeOnly:
		steps := []func() bool{d.startPrefill, d.decodeOnly, d.startDecode, d.finish}
		d.seq(steps[1-r.step:]...)
	case pathClientGone:
		steps := []func() bool{d.startPrefill, pf(true), d.startDecode}
		d.seq(append(steps[:r.step:r.step], gone)...)
	case pathPrefillAfterGone:
		d.seq(d.startPrefill, func() bool { d.clientGone(); return true }, pf(true))
	case pathDeadlineDecode:
		d.seq(d.startPrefill, pf(true), pastDeadline, d.startDecode, d.finish)
	case pathDeadlineFail:
		d.seq(d.startPrefill, pf(true), pastDeadline, d.startDecode, failNow)
	case pathFail:
		steps := []func() bool{d.startPrefill, pf(true), d.startDecode}
		d.seq(append(steps[:r.step+1:r.step+1], failNow)...)
	case pathDouble:
		d.twice = true
		two := func(s func() bool) func() bool { return func() bool { a := s(); b := s(); return a || b } }
		d.seq(two(d.startPrefill), two(pf(true)), two(d.startDecode), two(d.finish), func() bool {
			d.clientGone()
			d.clientGone()
			return true
		})
	case pathEndBeforeRelease:
		releaseLate = true
		d.seq(d.startPrefill, pf(true), gone)
	case pathEndBeforeDecodeRelease:
		releaseLate = true
		d.seq(d.startPrefill, pf(true), d.startDecode)
	case pathEndMidway:
		d.seq(d.startPrefill, pf(true))
	}

	if !releaseLate {
		d.releasePending()
	}
	d.end()
	if releaseLate {
		d.releasePending()
	}
	if r.path == pathLateAfterEnd {
		d.lateAfterEnd()
	}
	if r.abortAfter {
		w.abortAllCh <- struct{}{}
	}
}

// chaos fires events at random requests and holds until the drivers are done.
func (w *world) chaos(rng *rand.Rand, op func(rng *rand.Rand)) {
	for !w.done.Load() {
		op(rng)
		runtime.Gosched()
	}
}

func (w *world) chaosTarget(rng *rand.Rand, fire func(r *rec)) {
	r := w.rec[rng.IntN(len(w.rec))]
	if !r.chaos {
		return
	}
	r.gate.RLock()
	defer r.gate.RUnlock()
	if r.begun {
		fire(r)
	}
}

// TestConcurrentRequests drives thousands of requests through random paths from many
// goroutines while others fire duplicate and late events, then checks the table's invariants:
// one terminal state per request, every KV hold released exactly once, every gauge
// back to zero, nothing left in the table.
func TestConcurrentRequests(t *testing.T) {
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (rerun with -args -lifecycle.seed=%d)", seed, seed)

	const (
		requests = 4000
		drivers  = 32
		aborts   = 3 // AbortAll calls, at random points of the run
	)
	w := &world{
		t:          t,
		f:          newFixture(t, zaptest.Level(zapcore.InfoLevel)),
		wins:       make(map[*Hold]int),
		abortAllCh: make(chan struct{}, aborts),
	}
	plan := rand.New(rand.NewPCG(seed, 0))
	for i := range requests {
		r := &rec{
			id:    fmt.Sprintf("req-%05d", i),
			path:  path(plan.IntN(int(numPaths))),
			chaos: plan.IntN(4) == 0,
		}
		switch r.path {
		case pathClientGone:
			r.step = plan.IntN(4)
		case pathFail:
			r.step = plan.IntN(3)
		case pathDecodeOnly:
			r.step = plan.IntN(2)
		}
		w.rec = append(w.rec, r)
	}
	for range aborts {
		w.rec[plan.IntN(requests)].abortAfter = true
	}

	var chaosWG sync.WaitGroup
	for i, op := range []func(*rand.Rand){
		// A disconnect watcher: the client goes, the call is cancelled.
		func(rng *rand.Rand) {
			w.chaosTarget(rng, func(r *rec) {
				act, h, prev := w.f.tb.ClientGone(r.id)
				r.record(answer{event: "client_gone", by: "chaos", act: act, hold: h, prev: prev, afterEnd: r.ended})
				if h != nil {
					w.adopt(h)
					w.release(h, ReleaseDrained)
				}
				r.cancel()
			})
		},
		// The same, a second time at once.
		func(rng *rand.Rand) {
			w.chaosTarget(rng, func(r *rec) {
				act, h, prev := w.f.tb.ClientGone(r.id)
				r.record(answer{event: "client_gone", by: "chaos", act: act, hold: h, prev: prev, afterEnd: r.ended})
				if h != nil {
					w.adopt(h)
					w.release(h, ReleaseDrained)
				}
			})
		},
		// Time passing: a hold deadline may pass at any moment before the decode goes out, and
		// StartDecode then never forwards the params (R4).
		func(rng *rand.Rand) {
			w.f.clk.Advance(time.Duration(rng.Int64N(int64(testHoldTimeout / 16))))
		},
		// Duplicate releases of holds already handed out.
		func(rng *rand.Rand) {
			w.holdsMu.Lock()
			var h *Hold
			if n := len(w.pool); n > 0 {
				h = w.pool[rng.IntN(n)]
			}
			w.holdsMu.Unlock()
			if h != nil {
				w.release(h, ReleaseDrained)
			}
		},
		// /debug/requests: what it shows must agree with itself.
		func(*rand.Rand) {
			for _, in := range w.f.tb.Snapshot() {
				switch {
				case in.State == KVHeld && !in.KVHeld:
					t.Errorf("Snapshot: %s is kv_held with no KV held", in.ID)
				case (in.State == Received || in.State == Prefilling || in.State == Decoding || in.State == Finished) && in.KVHeld:
					t.Errorf("Snapshot: %s is %v and shows kv_held", in.ID, in.State)
				}
			}
		},
	} {
		rng := rand.New(rand.NewPCG(seed, uint64(100+i)))
		chaosWG.Go(func() { w.chaos(rng, op) })
	}
	chaosWG.Go(func() {
		for range w.abortAllCh {
			n := w.f.tb.AbortAll()
			t.Logf("AbortAll cancelled %d requests (%d in the table)", n, w.f.tb.Len())
			w.abortAllCancels.Add(int64(n))
		}
	})

	work := make(chan *rec)
	var driverWG sync.WaitGroup
	for range drivers {
		driverWG.Go(func() {
			for r := range work {
				(&driver{w: w, r: r}).run()
			}
		})
	}
	for _, r := range w.rec {
		work <- r
	}
	close(work)
	driverWG.Wait()
	w.done.Store(true)
	close(w.abortAllCh)
	chaosWG.Wait()

	w.check(t)
}

func (w *world) check(t *testing.T) {
	tb := w.f.tb
	finals := make(map[State]int)
	stages := make(map[State]int)
	paths := make(map[string]int)
	handedOut := make(map[*Hold]*rec)
	handedOver := make(map[*Hold]bool) // the holds StartDecode handed to the flow with the params
	var created, forwarded, deadlineExceeded, abortAllCalls int
	failures := 0
	fail := func(r *rec, format string, args ...any) {
		failures++
		if failures > 20 {
			return
		}
		var b strings.Builder
		for _, a := range r.answers {
			b.WriteString("\n\t\t" + a.String())
		}
		t.Errorf("%s (path %s, step %d, state at End %v): %s; answers:%s",
			r.id, pathNames[r.path], r.step, r.stateAtEnd, fmt.Sprintf(format, args...), b.String())
	}

	for _, r := range w.rec {
		paths[pathNames[r.path]]++
		abortAllCalls += int(r.abortAll.Load())
		created += r.holdsCreated
		deadlineExceeded += r.deadlineExceeded
		if !r.knownAtEnd {
			fail(r, "the table did not know the request when its End came")
			continue
		}
		// The one terminal state: what it was at End, or failed by End itself.
		final := r.stateAtEnd
		var proofs []string
		if !final.Terminal() {
			final = Failed
			proofs = append(proofs, "end")
		}
		finals[final]++
		calledFail, fwd, releases := false, 0, 0
		for _, a := range r.answers {
			if a.afterEnd {
				if a.ok || a.fwd || a.act != None || a.hold != nil || (a.event == "client_gone" && a.prev != Aborted) {
					fail(r, "%v after End was not a no-op", a)
				}
				continue
			}
			if a.act == ReleaseKV {
				releases++
				if a.hold == nil {
					fail(r, "%v asks for a release without a hold", a)
				} else if other, dup := handedOut[a.hold]; dup {
					fail(r, "%v hands out a hold already handed out to %s", a, other.id)
				} else {
					handedOut[a.hold] = r
				}
			} else if a.hold != nil && a.event != "decode_start" {
				fail(r, "%v hands out a hold without asking for a release", a)
			}
			switch a.event {
			case "client_gone":
				if a.prev.Terminal() {
					if a.prev != final {
						fail(r, "%v saw %v but the request ended %v", a, a.prev, final)
					}
					if a.act != None {
						fail(r, "%v: a late client_gone asked for %v", a, a.act)
					}
					continue
				}
				proofs = append(proofs, a.String())
				stages[a.prev]++
				want := map[State]Action{Received: None, Prefilling: CancelPrefill, KVHeld: ReleaseKV, Decoding: CancelDecode}[a.prev]
				if a.act != want {
					fail(r, "%v: want %v in %v", a, want, a.prev)
				}
				if final != Aborted {
					fail(r, "%v aborted it, yet it ended %v", a, final)
				}
			case "finish":
				if a.ok {
					proofs = append(proofs, a.String())
					if final != Finished {
						fail(r, "%v, yet it ended %v", a, final)
					}
				}
			case "fail":
				calledFail = true
				if a.act == ReleaseKV {
					proofs = append(proofs, a.String())
				}
			case "prefilled":
				if a.act == ReleaseKV && final != Aborted {
					fail(r, "%v asked for an R1 release, yet it ended %v", a, final)
				}
			case "decode_start":
				if a.fwd {
					fwd++
				}
				if (a.hold != nil) != a.fwd {
					fail(r, "%v: a hold goes with the params, and only with them", a)
				}
				if a.hold != nil {
					if other, dup := handedOut[a.hold]; dup {
						fail(r, "%v hands out a hold already handed out to %s", a, other.id)
					} else {
						handedOut[a.hold] = r
						handedOver[a.hold] = true
					}
				}
			}
		}
		forwarded += fwd
		switch {
		case len(proofs) > 1:
			fail(r, "%d transitions ended it: %v", len(proofs), proofs)
		case len(proofs) == 0 && !(final == Failed && calledFail):
			fail(r, "it ended %v with no transition to show for it", final)
		}
		if fwd+releases > 1 {
			fail(r, "its KV went to a decoder %d times and to a release %d times", fwd, releases)
		}
	}

	// Every hold handed out was released exactly once by the one who got it (or, when End came
	// first, by End, after which the owner's release answered false). End never releases a hold
	// StartDecode handed over: its owner's release always wins.
	for h, r := range handedOut {
		if !h.Released() {
			fail(r, "a hold handed out was never released")
		}
		wins := w.wins[h]
		switch {
		case handedOver[h] && wins != 1:
			fail(r, "the hold StartDecode handed over was released %d times by its owner, want 1", wins)
		case wins > 1 || (wins == 0 && !r.path.releasesAfterEnd()):
			fail(r, "a hold handed out was released %d times", wins)
		}
	}

	m := gather(t, w.f.reg)
	for _, s := range liveStates {
		if v := m[mInflight(s)]; v != 0 {
			t.Errorf("%s = %v after every request ended, want 0", mInflight(s), v)
		}
		if got, want := m[mAborts(s)], float64(stages[s]); got != want {
			t.Errorf("%s = %v, want %v (the client_gone answers that aborted in %v)", mAborts(s), got, want, s)
		}
	}
	var abortsTotal, releasesTotal float64
	for _, s := range liveStates {
		abortsTotal += m[mAborts(s)]
	}
	for _, r := range allReasons {
		releasesTotal += m[mReleases(r)]
	}
	checks := []struct {
		what      string
		got, want float64
	}{
		{"sum of pdproxy_aborts_total (each aborted request counted once)", abortsTotal, float64(finals[Aborted])},
		{"sum of pdproxy_kv_releases_total (each hold released once)", releasesTotal, float64(created)},
		{mReleases(ReleaseDecoded) + " (decodes that got the params)", m[mReleases(ReleaseDecoded)], float64(forwarded)},
		{mDeadlineExceeded, m[mDeadlineExceeded], float64(deadlineExceeded)},
		{mHeld, m[mHeld], 0},
		{"OutstandingHolds()", float64(tb.OutstandingHolds()), 0},
		{mLate("release") + " (releases that answered false)", m[mLate("release")], float64(w.releaseFalse)},
		{"Len()", float64(tb.Len()), 0},
		{"cancel calls by AbortAll", float64(abortAllCalls), float64(w.abortAllCancels.Load())},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.what, c.got, c.want)
		}
	}
	if failures > 20 {
		t.Errorf("... and %d more request failures", failures-20)
	}
	t.Logf("paths %v", paths)
	t.Logf("ended: finished %d, aborted %d, failed %d; holds %d (handed out %d, with the params %d), decoded %d, deadline exceeded %d, AbortAll cancels %d",
		finals[Finished], finals[Aborted], finals[Failed], created, len(handedOut), len(handedOver), forwarded, deadlineExceeded, abortAllCalls)
}
