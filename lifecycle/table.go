package lifecycle

import (
	"errors"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// ErrDuplicate is returned by Begin when a request with the same id is already in flight.
var ErrDuplicate = errors.New("a request with this id is already in flight")

// Config tunes a Table.
type Config struct {
	// KVHoldTimeout bounds how long the proxy may forward a prefiller's kv_transfer_params
	// after the prefill answered. Zero means 30s. It must not be longer than the engines' own
	// hold timeout, or a decoder could read blocks the prefiller already reused (race R4).
	KVHoldTimeout time.Duration
	// Now is the clock; nil means time.Now. Tests inject one to pass deadlines without sleeping.
	Now func() time.Time
}

// Table is the request table. The zero value is not usable; call New.
type Table struct {
	holdTimeout time.Duration
	now         func() time.Time
	logger      *zap.Logger
	m           *metrics

	mu   sync.Mutex
	reqs map[string]*entry

	holds atomic.Int64 // holds recorded and not yet released
}

type entry struct {
	id      string
	route   string
	state   State
	started time.Time
	prefill string
	decode  string
	cancel  func()
	// hold is the KV hold the table keeps for the request, from the prefill's answer until
	// StartDecode hands it to the caller (then nil: the caller owns it) or it is released.
	hold *Hold
	// deadline is when the hold the prefill's answer recorded stops being forwardable; zero
	// when the answer recorded none. It stays once StartDecode clears hold, so it also tells
	// that the request had a hold.
	deadline time.Time
	// paired says the request went out on paired legs (StartLegs): the room's hold recorded
	// then is the only hold it ever has, and only LegsJoined, ClientGone, Fail or End end it.
	paired bool
	// attempts counts the request's tries after its first (Continue): each has its own legs
	// and its own hold.
	attempts int
}

// New returns an empty table that registers its metrics on reg.
func New(cfg Config, logger *zap.Logger, reg prometheus.Registerer) *Table {
	if cfg.KVHoldTimeout <= 0 {
		cfg.KVHoldTimeout = 30 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	return &Table{
		holdTimeout: cfg.KVHoldTimeout,
		now:         cfg.Now,
		logger:      logger,
		m:           newMetrics(reg),
		reqs:        make(map[string]*entry),
	}
}

// KVHoldTimeout is the configured hold deadline.
func (t *Table) KVHoldTimeout() time.Duration { return t.holdTimeout }

// Hold is one KV hold on a prefiller, with what names its blocks: whoever the table hands it
// to (a decode, a release) has the params with it. Release ends it; only the first call counts.
type Hold struct {
	t  *Table
	id string
	// since is when the hold was recorded: the prefiller's answer, or the paired legs' start.
	since time.Time
	// params are the prefiller's KV params (kv_transfer_params) that name the blocks; nil on
	// paired legs, whose params never pass through the proxy.
	params   []byte
	released atomic.Bool
	// claimed: a release took the hold on (Claim), and ends it itself.
	claimed atomic.Bool
}

// Claim records that a release takes the hold on: it ends it, by its drain, abort or the
// engine's timer. It reports whether this call was the one that claimed it. A claimed hold is
// left to its release: the table's End does not sweep it, nor does any other path that ends
// the holds a request left (a panic's safety net). Nil claims nothing.
func (h *Hold) Claim() bool { return h != nil && h.claimed.CompareAndSwap(false, true) }

// Claimed reports whether a release took the hold on.
func (h *Hold) Claimed() bool { return h != nil && h.claimed.Load() }

// Params are the prefiller's KV params that name the held blocks, as its answer gave them;
// nil on paired legs. They never change.
func (h *Hold) Params() []byte {
	if h == nil {
		return nil
	}
	return h.params
}

// Since is when the prefiller began to hold the blocks: its answer, or the paired legs' start.
func (h *Hold) Since() time.Time {
	if h == nil {
		return time.Time{}
	}
	return h.since
}

// Left is how much longer the hold's params may go to a decoder: until the hold deadline
// (kv_hold_timeout after the prefiller's answer), by the table's clock; zero or less once it
// passed, and for paired legs' holds, whose params never pass through the proxy.
func (h *Hold) Left() time.Duration {
	if h == nil || h.params == nil {
		return 0
	}
	return h.since.Add(h.t.holdTimeout).Sub(h.t.now())
}

// Release records that the hold is over, for the given reason. It reports whether this call
// was the one that released it; every later call is a counted late event and changes nothing.
func (h *Hold) Release(reason ReleaseReason) bool {
	return h.release(reason, true)
}

// release is Release; countLate false is for the table's own sweep in End, which only tidies
// up after an owner and so is never itself a late event when the owner got there first.
func (h *Hold) release(reason ReleaseReason, countLate bool) bool {
	if h == nil {
		return false
	}
	if !h.released.CompareAndSwap(false, true) {
		if countLate {
			h.t.late("release", h.id)
		}
		return false
	}
	h.t.holds.Add(-1)
	h.t.m.held.Dec()
	h.t.m.releases.WithLabelValues(string(reason)).Inc()
	h.t.m.handoffs.WithLabelValues(reason.handoff()).Inc()
	return true
}

// Released reports whether the hold has been released.
func (h *Hold) Released() bool { return h != nil && h.released.Load() }

// OutstandingHolds counts holds recorded and not yet released; it is 0 when the proxy holds
// nothing on any prefiller. Tests check it after every run.
func (t *Table) OutstandingHolds() int64 { return t.holds.Load() }

// Begin records a new request in Received. cancel, if not nil, is called by AbortAll (shutdown):
// it must cancel the request's context, after which the request's own flow reports ClientGone.
func (t *Table) Begin(id, route string, cancel func()) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.reqs[id]; ok {
		return ErrDuplicate
	}
	t.reqs[id] = &entry{id: id, route: route, state: Received, started: t.now(), cancel: cancel}
	t.m.inflight.WithLabelValues(Received.String()).Inc()
	return nil
}

// End forgets a request. A request still in a non-terminal state is first marked failed, so no
// path (a recovered panic included) leaves an in-flight count or a hold behind; a hold that is
// still unreleased then is released as expired: nobody will forward its params any more, and
// the engine's own timer frees it.
func (t *Table) End(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.reqs[id]
	if !ok {
		return
	}
	if !e.state.Terminal() {
		t.setState(e, Failed)
	}
	delete(t.reqs, id)
	// A hold a release claimed is the release's to end. An owner may be releasing an
	// unclaimed one at the same moment: whoever loses the race changes nothing, and End losing
	// it is no late event.
	if !e.hold.Claimed() {
		e.hold.release(ReleaseExpired, false)
	}
}

// StartLegs moves a request from Received to Prefilling as its two legs go out together to
// prefill and decode (SGLang): the prefiller holds the request's KV in a bootstrap room from
// now until the decoder claims it. The hold is recorded at once, with no forwarding deadline
// (no params travel through the proxy); LegsJoined ends it, or a ClientGone or Fail hands it
// to the caller, who aborts the legs. It answers false when the request is no longer in
// Received (the client left): then nothing may be sent.
func (t *Table) StartLegs(id, prefill, decode string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "legs_start")
	if e == nil || e.state != Received {
		if e != nil {
			t.late("legs_start", id)
		}
		return false
	}
	e.prefill, e.decode = prefill, decode
	e.paired = true
	e.hold = t.newHold(id)
	t.setState(e, Prefilling)
	return true
}

// LegsJoined records that the decoder has the KV of a request on paired legs (its answer
// began, or the prefiller finished the transfer): the room's hold ends as decoded, and the
// request is decoding. In any other state it is a counted no-op.
func (t *Table) LegsJoined(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "legs_joined")
	if e == nil {
		return false
	}
	if e.state != Prefilling || e.hold == nil {
		t.late("legs_joined", id)
		return false
	}
	e.hold.Release(ReleaseDecoded)
	e.hold = nil
	t.setState(e, Decoding)
	return true
}

// StartPrefill moves a request from Received to Prefilling. It answers false when the request
// is no longer in Received (the client left): then nothing may be sent.
func (t *Table) StartPrefill(id, backend string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "prefill_start")
	if e == nil || e.state != Received {
		if e != nil {
			t.late("prefill_start", id)
		}
		return false
	}
	e.prefill = backend
	t.setState(e, Prefilling)
	return true
}

// PrefillRetry records that the prefill moved to another backend. It answers false for a
// request no longer prefilling, or on paired legs.
func (t *Table) PrefillRetry(id, backend string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "prefill_retry")
	// Paired legs never move: the room, and so the hold, is on the prefiller they went to.
	if e == nil || e.state != Prefilling || e.paired {
		if e != nil {
			t.late("prefill_retry", id)
		}
		return false
	}
	e.prefill = backend
	return true
}

// Prefilled records the prefiller's answer. params are the kv_transfer_params it returned (nil
// for none): it now holds blocks for this request, and the hold keeps the params that name them.
// The table keeps the hold until StartDecode hands it to the decode, or ClientGone, Fail or
// Retry to a release. In Prefilling that leads to KVHeld with a deadline
// (or, without a hold, straight on to the decode). If the request was aborted meanwhile (race
// R1: the abort reached the engine after its final step), the hold is recorded and the answer
// is ReleaseKV with the hold to release: the engine will not free it before its timer. For a
// request on paired legs (StartLegs) it is a counted no-op: LegsJoined is their answer.
func (t *Table) Prefilled(id string, params []byte) (Action, *Hold) {
	holdsKV := params != nil
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "prefill_done")
	if e == nil {
		return None, nil
	}
	switch {
	case e.paired:
		// Paired legs have no prefill answer of this kind: their room's hold is already
		// recorded. One would make a second hold (losing the room's), move the request on
		// with the room's hold left in the table, or, once the legs joined and the client
		// left, take a hold for KV the decoder already has.
		t.late("prefill_done", id)
		return None, nil
	case e.state == Prefilling && holdsKV:
		e.hold = t.newHold(id)
		e.hold.params = params
		e.deadline = t.now().Add(t.holdTimeout)
		t.setState(e, KVHeld)
		return None, nil
	case e.state == Prefilling:
		t.setState(e, Decoding)
		return None, nil
	case e.state == Aborted && holdsKV && e.hold == nil && e.deadline.IsZero():
		// Only when no prefill answer recorded a hold: after the decode went out (hold then
		// nil) a repeated answer must not make a second hold for KV a decoder may be pulling.
		e.hold = t.newHold(id)
		e.hold.params = params
		return ReleaseKV, e.hold
	default:
		t.late("prefill_done", id)
		return None, nil
	}
}

// DecodeOnly records that the request goes to a decoder without a prefill (no prefiller
// could serve it, or the engine cannot serve it disaggregated): the decoder computes the
// prompt itself. It answers false when the request is no longer waiting for a prefill (the
// client left, or the request is on paired legs): then nothing may be sent.
func (t *Table) DecodeOnly(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "decode_only")
	if e == nil {
		return false
	}
	// Paired legs have no prefill to fall back from: their decode leg is already out, and the
	// room's hold must stay where LegsJoined or ClientGone finds it.
	if e.state != Received && (e.state != Prefilling || e.paired) {
		t.late("decode_only", id)
		return false
	}
	t.setState(e, Decoding)
	return true
}

// StartDecode moves a request to Decoding as its decode call goes out. forwardKV says whether
// the prefiller's params may go with it: false once the hold deadline has passed (race R4),
// and the hold then ends as expired. When they may, the hold comes back to the caller, who
// owns it from then on and must Release it exactly once: as decoded once the decoder has
// the call (it then pulls the blocks and notifies the prefiller), or through a release of
// its own when the decoder never got it (the client left before, the connection failed),
// or the prefiller would keep the blocks until its own timer. ok is false when the request
// is no longer in a state that may decode (the client left): then nothing may be sent.
func (t *Table) StartDecode(id, backend string) (forwardKV bool, hold *Hold, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "decode_start")
	if e == nil {
		return false, nil, false
	}
	switch e.state {
	case KVHeld:
		forwardKV = !t.now().After(e.deadline)
		if forwardKV {
			hold = e.hold
		} else {
			t.m.expiredForwards.Inc()
			e.hold.Release(ReleaseExpired)
		}
		e.hold = nil
	case Received, Decoding:
	default:
		t.late("decode_start", id)
		return false, nil, false
	}
	e.decode = backend
	t.setState(e, Decoding)
	return forwardKV, hold, true
}

// Continue starts another attempt of a request whose decoder failed or went away while it
// decoded (a stream that continues on other engines): it goes back to Received, with no legs
// and no hold, and from there through the same transitions as a new request. ok is false
// when the request is no longer decoding (the client left, shutdown aborted it, or it ended):
// nothing may be sent then.
func (t *Table) Continue(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "continue")
	if e == nil {
		return false
	}
	if e.state != Decoding || e.hold != nil && !e.hold.Released() {
		t.late("continue", id)
		return false
	}
	t.nextAttempt(e)
	return true
}

// Retry starts another attempt of a request whose pair failed before its client got anything
// (a decoder that died or refused, a prefill leg that failed, a KV pull that failed): it goes
// back to Received, with no legs and no hold, as Continue does. A hold the attempt still had
// comes back, to be released by the caller as the attempt's own (the entry keeps none). ok is
// false when the request is not between its first leg and its answer (the client left,
// shutdown aborted it, or it ended): nothing may be sent then.
func (t *Table) Retry(id string) (hold *Hold, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "retry")
	if e == nil {
		return nil, false
	}
	switch e.state {
	case Prefilling, KVHeld, Decoding:
	default:
		t.late("retry", id)
		return nil, false
	}
	if e.hold != nil && !e.hold.Released() {
		hold = e.hold
	}
	t.nextAttempt(e)
	return hold, true
}

// nextAttempt starts e's next attempt: back in Received, with no legs and no hold. Callers
// hold t.mu.
func (t *Table) nextAttempt(e *entry) {
	e.attempts++
	e.prefill, e.decode, e.hold, e.deadline, e.paired = "", "", nil, time.Time{}, false
	t.setState(e, Received)
}

// Finish ends a request that completed.
func (t *Table) Finish(id string) bool {
	return t.end(id, "finish", Finished, Decoding) != nil
}

// Fail ends a request that failed. If the prefiller still holds KV for it, the answer is
// ReleaseKV with the hold to release.
func (t *Table) Fail(id string) (Action, *Hold) {
	return t.endWithHold(id, "fail", Failed)
}

// ClientGone records that the client left and answers what to abort: nothing in Received,
// the prefill call in Prefilling, the held KV in KVHeld, the decode call in Decoding. It also
// returns the state the request was in (the stage label of pdproxy_aborts_total). In a
// terminal state it is a counted no-op (races R3, R5).
func (t *Table) ClientGone(id string) (Action, *Hold, State) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, "client_gone")
	if e == nil {
		return None, nil, Aborted
	}
	prev := e.state
	var act Action
	var hold *Hold
	switch prev {
	case Received:
	case Prefilling:
		// A request on paired legs holds its room from the start (StartLegs): it comes back
		// with the cancel, to be released by the engines' aborts.
		act, hold = CancelPrefill, e.hold
	case KVHeld:
		act, hold = ReleaseKV, e.hold
	case Decoding:
		act = CancelDecode
	default:
		t.late("client_gone", id)
		return None, nil, prev
	}
	t.m.aborts.WithLabelValues(prev.String()).Inc()
	t.setState(e, Aborted)
	return act, hold, prev
}

// State returns a request's state and whether the table knows it.
func (t *Table) State(id string) (State, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.reqs[id]; ok {
		return e.state, true
	}
	return 0, false
}

// AbortAll cancels every request in flight (graceful shutdown past its drain deadline). Each
// request's flow then sees its context done and aborts its stage as ClientGone says.
func (t *Table) AbortAll() int {
	t.mu.Lock()
	var cancels []func()
	for _, e := range t.reqs {
		if !e.state.Terminal() && e.cancel != nil {
			cancels = append(cancels, e.cancel)
		}
	}
	t.mu.Unlock()
	for _, c := range cancels {
		c()
	}
	return len(cancels)
}

// Len counts the requests in the table.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.reqs)
}

// Info is one row of the inspection view (GET /debug/requests).
type Info struct {
	ID         string  `json:"id"`
	Route      string  `json:"route"`
	State      State   `json:"state"`
	AgeSeconds float64 `json:"age_seconds"`
	Prefill    string  `json:"prefill,omitempty"`
	Decode     string  `json:"decode,omitempty"`
	KVHeld     bool    `json:"kv_held"`
	// KVHoldAgeSeconds is how long the prefiller has held the request's KV, from the
	// prefill's answer (or, on paired legs, from when they went out); absent unless KVHeld.
	KVHoldAgeSeconds *float64 `json:"kv_hold_age_seconds,omitempty"`
	// KVHoldDeadlineInSeconds is the time left until the hold's params may no longer be
	// forwarded to a decoder (the table's kv_hold_timeout after the prefill's answer),
	// negative once it passed; absent unless KVHeld, and on paired legs, whose params never
	// pass through the proxy.
	KVHoldDeadlineInSeconds *float64 `json:"kv_hold_deadline_in_seconds,omitempty"`
	// Attempts counts the request's tries after its first: a stream whose decoder failed or
	// went away goes on under the same entry, on other engines (Continue).
	Attempts int `json:"attempts,omitempty"`
}

// Snapshot lists the requests in flight, oldest first.
func (t *Table) Snapshot() []Info {
	now := t.now()
	t.mu.Lock()
	out := make([]Info, 0, len(t.reqs))
	for _, e := range t.reqs {
		in := Info{
			ID: e.id, Route: e.route, State: e.state,
			AgeSeconds: now.Sub(e.started).Seconds(),
			Prefill:    e.prefill, Decode: e.decode,
			KVHeld:   e.hold != nil && !e.hold.Released(),
			Attempts: e.attempts,
		}
		if in.KVHeld {
			age := now.Sub(e.hold.since).Seconds()
			in.KVHoldAgeSeconds = &age
			if !e.deadline.IsZero() {
				left := e.deadline.Sub(now).Seconds()
				in.KVHoldDeadlineInSeconds = &left
			}
		}
		out = append(out, in)
	}
	t.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].AgeSeconds > out[j].AgeSeconds })
	return out
}

func (t *Table) end(id, event string, to State, from ...State) *entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, event)
	if e == nil {
		return nil
	}
	for _, f := range from {
		if e.state == f {
			t.setState(e, to)
			return e
		}
	}
	t.late(event, id)
	return nil
}

func (t *Table) endWithHold(id, event string, to State) (Action, *Hold) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.lookup(id, event)
	if e == nil {
		return None, nil
	}
	if e.state.Terminal() {
		t.late(event, id)
		return None, nil
	}
	t.setState(e, to)
	if e.hold != nil && !e.hold.Released() {
		return ReleaseKV, e.hold
	}
	return None, nil
}

// lookup finds an entry; an unknown id is a late event. Callers hold t.mu.
func (t *Table) lookup(id, event string) *entry {
	e, ok := t.reqs[id]
	if !ok {
		t.late(event, id)
		return nil
	}
	return e
}

func (t *Table) newHold(id string) *Hold {
	t.holds.Add(1)
	t.m.held.Inc()
	return &Hold{t: t, id: id, since: t.now()}
}

// setState moves e to s and keeps the per-state in-flight gauge right. Callers hold t.mu.
func (t *Table) setState(e *entry, s State) {
	if !e.state.Terminal() {
		t.m.inflight.WithLabelValues(e.state.String()).Dec()
	}
	e.state = s
	if !s.Terminal() {
		t.m.inflight.WithLabelValues(s.String()).Inc()
	}
}

func (t *Table) late(event, id string) {
	t.m.late.WithLabelValues(event).Inc()
	if ce := t.logger.Check(zap.DebugLevel, "late event ignored"); ce != nil {
		ce.Write(zap.String("request_id", id), zap.String("event", event))
	}
}
