package sim

import (
	"cmp"
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Run is the scheduler loop. It steps whenever events arrive or work is due,
// sleeps otherwise, and returns nil once ctx is done, after aborting every
// request and freeing every block.
func (e *Engine) Run(ctx context.Context) error {
	e.mu.Lock()
	again := e.started
	e.started = true
	e.mu.Unlock()
	if again {
		return errors.New("sim: engine Run called twice")
	}
	if e.boot != nil {
		// Deferred before shutdown, so it runs after it: the rooms are gone
		// by then and every request waiting for one has its answer.
		e.boot.srv.Handler = e.bootstrapHandler()
		stop := e.boot.serve(e.log)
		defer stop()
	}
	if len(e.ranks) > 1 {
		// The other ranks stop with ctx; the bootstrap server, which serves
		// their pulls too, closes after them.
		var wg sync.WaitGroup
		errs := make([]error, len(e.ranks))
		for i, r := range e.ranks[1:] {
			wg.Go(func() { errs[i+1] = r.Run(ctx) })
		}
		defer func() {
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				e.log.Error("data parallel rank stopped", zap.Error(err))
			}
		}()
	}
	defer e.client.CloseIdleConnections()
	if e.kv != nil {
		// Deferred before shutdown, so it runs after it: the loop stops
		// once the engine's last events are queued, and sends them.
		kctx, stop := context.WithCancel(context.WithoutCancel(ctx))
		var wg sync.WaitGroup
		wg.Go(func() { e.kv.run(kctx) })
		defer wg.Wait()
		defer stop()
	}
	defer e.shutdown()
	if e.cfg.KVHeartbeatInterval > 0 {
		// Deferred after shutdown, so they run before it: the loop stops and
		// is waited for while the engine still knows its requests.
		// The first round's timer is armed here, before the scheduler below
		// serves anything: a fake clock advanced once a request is queued
		// finds it, however late the loop's goroutine runs.
		hctx, stop := context.WithCancel(ctx)
		first := e.clock.NewTimer(e.cfg.KVHeartbeatInterval)
		var wg sync.WaitGroup
		wg.Go(func() { e.heartbeatLoop(hctx, first) })
		defer wg.Wait()
		defer stop()
	}
	for {
		if ctx.Err() != nil {
			return nil
		}
		now := e.clock.Now()
		next, ok := e.step(now)
		if ok && !next.After(now) {
			continue // more work is due at once (ITL 0)
		}
		var (
			fire  <-chan time.Time
			timer Timer
		)
		if ok {
			// From the clock's time now, not the step's: a test's fake clock
			// may have moved during the step.
			timer = e.clock.NewTimer(next.Sub(e.clock.Now()))
			fire = timer.C()
		}
		select {
		case <-ctx.Done():
		case <-e.wake:
		case <-fire:
		}
		if timer != nil {
			timer.Stop()
		}
	}
}

// step is one scheduler iteration, vLLM style: apply the events that arrived
// since the last step (adds, aborts, finished-sending and finished-receiving
// notifications) in arrival order, expire holds, admit waiting requests,
// advance every running request by at most one token, then admit again into
// what the requests that ended freed. It returns the earliest
// time more work is due, ok=false if nothing is scheduled (only events can
// bring work then).
func (e *Engine) step(now time.Time) (next time.Time, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	inbox := e.inbox
	e.inbox = nil
	for _, ev := range inbox {
		e.apply(ev, now)
	}
	e.expire(now)
	e.schedule(now)
	e.advance(now)
	// The requests that ended in advance freed blocks and running slots: the waiting ones
	// are admitted now, or they would wait for the next event, which may never come.
	e.schedule(now)
	e.publishEvents(now)
	return e.nextDue()
}

// publishEvents hands the cache's changes of this step to the publisher as
// one batch, as vLLM publishes one batch per engine step.
func (e *Engine) publishEvents(now time.Time) {
	evs := e.pool.takeEvents()
	if len(evs) > 0 && e.kv != nil {
		e.kv.publish(now, evs)
	}
}

// cachePrompt puts r's computed (or pulled) full prompt blocks in the
// prefix cache.
func (e *Engine) cachePrompt(r *request) {
	if r.blockHashes != nil {
		e.pool.store(r.blocks, r.blockHashes, r.tokens, e.cfg.BlockSize, r.key)
	}
}

// computeTime is what r's prompt costs past the fixed PrefillTime: its
// uncached tokens computed, the blocks the CPU tier held reloaded.
func (e *Engine) computeTime(r *request) time.Duration {
	return time.Duration(r.promptTokens-r.cachedTokens)*e.cfg.PrefillPerToken +
		time.Duration(r.reloadedBlocks)*e.cfg.CPUReloadPerBlock
}

func (e *Engine) apply(ev event, now time.Time) {
	switch ev.kind {
	case evAdd:
		e.add(ev.req, now)
	case evAbort:
		r := ev.req
		if r.state == stateHeld && r.room != nil {
			// SGLang aborts a request whose client left, held room or not.
			e.abortRoom(r)
			return
		}
		if !r.isLive() {
			// vLLM raised KeyError here when the abort raced the request's
			// finish (races R1/R5). A finished request keeps its hold.
			e.late("abort of a finished request ignored", r.rid, r.state)
			return
		}
		e.endLive(r, output{kind: outEnd, err: errAborted})
		e.counts.aborted++
	case evAbortRID:
		if ev.prefix {
			e.abortPrefix(ev)
			return
		}
		found := false
		if r, ok := e.live[ev.rid]; ok {
			e.endLive(r, output{kind: outEnd, err: errAborted})
			e.counts.aborted++
			found = true
		}
		if h, ok := e.held[ev.rid]; ok {
			e.freeHeld(h, errAborted)
			e.counts.aborted++
			found = true
		}
		if !found {
			e.late("abort of an unknown request ignored", ev.rid, stateDone)
		}
	case evFinishedSending:
		h, ok := e.held[ev.rid]
		if !ok {
			// vLLM asserted `req_id in self.requests` here and crashed when
			// the request had been aborted or expired meanwhile (race R3).
			e.late("finished_sending for a request no longer held ignored", ev.rid, stateDone)
			return
		}
		e.freeHeld(h, transferOutcome(ev.outcome))
		if ce := e.log.Check(zap.DebugLevel, "kv read complete, blocks freed"); ce != nil {
			ce.Write(zap.String("request_id", ev.rid), zap.Int("blocks", len(h.blocks)))
		}
	case evHeartbeat:
		e.renewLeases(ev.rids, now)
	case evFinishedReceving:
		r := ev.req
		if r.state != statePulling {
			e.late("finished_receiving for a request not pulling ignored", r.rid, r.state)
			return
		}
		if ev.err != nil {
			e.endLive(r, output{kind: outEnd, err: statusError(http.StatusInternalServerError, "kv_transfer_failed",
				"kv transfer from the prefiller failed: %v", ev.err)})
			return
		}
		if !r.readsKV() && e.cfg.PrefillPerToken > 0 {
			// Nothing to pull: the decoder computes the prompt's uncached
			// tokens itself, and caches them when done (advance).
			r.state = statePrefilling
			r.readyAt = e.prefillDone(now, e.computeTime(r))
			return
		}
		// The pulled blocks join this engine's own cache, with those it had.
		e.cachePrompt(r)
		r.state = stateDecoding
		r.readyAt = now
	}
}

func (e *Engine) add(r *request, now time.Time) {
	_, dupLive := e.live[r.rid]
	_, dupHeld := e.held[r.rid]
	// A decode may share its id with a prefill held on this same engine (P and
	// D on one server); anything else with a live id is a client error.
	if dupLive || (dupHeld && r.kind != kindDecode) {
		r.state = stateDone
		r.push(output{kind: outEnd, err: badRequest("duplicate_request_id", "request id %q is already in use on this engine", r.rid)})
		return
	}
	r.arrived = now
	if r.kind == kindPrefill && r.leg != nil && !e.openRoom(r) {
		r.state = stateDone
		r.push(output{kind: outEnd, err: badRequest("duplicate_bootstrap_room", "bootstrap_room %d is already in use on this engine", r.leg.room)})
		return
	}
	if r.kind == kindPrefill && r.xferID != "" && !e.openTransfer(r) {
		r.state = stateDone
		r.push(output{kind: outEnd, err: badRequest("duplicate_transfer_id", "transfer_id %q is already in use on this engine", r.xferID)})
		return
	}
	e.counts.requests++
	e.counts.priorities[r.priority]++
	if r.crashes {
		e.crash(r)
		return
	}
	r.state = stateWaiting
	e.live[r.rid] = r
	if e.cfg.SchedulingPolicy != SchedulingPriority {
		e.waiting = append(e.waiting, r)
		return
	}
	// vLLM's priority policy: the waiting queue in (priority, arrival)
	// order, lower first. (vLLM also preempts running requests for a more
	// urgent one; the sim does not.)
	i, _ := slices.BinarySearchFunc(e.waiting, r, func(w, r *request) int {
		if w.priority != r.priority {
			return cmp.Compare(w.priority, r.priority)
		}
		return cmp.Compare(w.seq, r.seq)
	})
	e.waiting = slices.Insert(e.waiting, i, r)
}

// errEngineDead is what every request of a crashed engine gets.
var errEngineDead = statusError(http.StatusInternalServerError, "engine_dead",
	"the engine crashed: prompt logprobs were asked of a request whose KV came from a prefiller (vLLM #50792)")

// crash models vLLM #50792: prompt_logprobs (or echo with logprobs) on a
// decode with kv_transfer_params kills a vLLM decoder's engine, and every
// request it has fails with a 500. The sim restarts at once: its pool is
// whole again (holds included: a dead engine's GPU memory is gone) and it
// serves the next request. A dead engine tells no prefiller anything, so
// the prefillers' holds for these decodes end with their leases.
func (e *Engine) crash(cause *request) {
	e.counts.crashes++
	e.log.Error("engine crashed: prompt logprobs asked of a decode with remote kv, every request fails",
		zap.String("request_id", cause.rid), zap.Int("live_requests", len(e.live)), zap.Int("held_requests", len(e.held)))
	dead := output{kind: outEnd, err: errEngineDead, crashed: true}
	for _, r := range e.live {
		e.endLive(r, dead)
	}
	for _, h := range e.held {
		e.freeHeld(h, errEngineDead)
	}
	cause.state = stateDone
	cause.push(dead)
	e.pool.clear()
}

// late counts and logs an event that found nothing to act on.
func (e *Engine) late(msg, rid string, st reqState) {
	e.counts.lateEvents++
	e.log.Warn(msg, zap.String("request_id", rid), zap.Uint8("state", uint8(st)))
}

// release frees r's blocks exactly once: the pool's ownership check turns
// any second attempt into a counted double free.
func (e *Engine) release(r *request) {
	if n := e.pool.release(r.blocks, r.seq); n > 0 {
		e.counts.doubleFrees += n
		e.log.Error("double free of kv blocks detected", zap.String("request_id", r.rid), zap.Int("blocks", n))
	}
	r.blocks = nil
}

// endLive ends a live request: frees its blocks, removes it, tells its handler.
func (e *Engine) endLive(r *request, o output) {
	e.release(r)
	r.state = stateDone
	delete(e.live, r.rid)
	if r.room != nil {
		e.closeRoom(r.room)
	}
	if r.xfer != nil {
		e.closeTransfer(r.xfer)
	}
	o.complete = r.generated
	r.push(o)
}

// freeHeld frees a hold; why is how it ended (nil: the decoder read it),
// which an SGLang prefill answers its leg with.
func (e *Engine) freeHeld(h *request, why error) {
	e.release(h)
	h.state = stateDone
	delete(e.held, h.rid)
	if h.room != nil {
		e.closeRoom(h.room)
	}
	if h.xfer != nil {
		e.closeTransfer(h.xfer)
	}
	if !h.legEnded {
		h.legEnded = true
		h.push(output{kind: outReleased, err: why})
	}
}

// expire frees the holds past their deadline. It scans only when the
// earliest known deadline has passed, so a step stays cheap with many holds.
func (e *Engine) expire(now time.Time) {
	if e.holdDue.IsZero() || now.Before(e.holdDue) {
		return
	}
	e.holdDue = time.Time{}
	for rid, h := range e.held {
		if h.expiresAt.IsZero() {
			continue // an SGLang room asked for, or with no bootstrap timeout
		}
		if now.Before(h.expiresAt) {
			if e.holdDue.IsZero() || h.expiresAt.Before(e.holdDue) {
				e.holdDue = h.expiresAt
			}
			continue
		}
		e.counts.expired++
		if h.room != nil {
			e.freeHeld(h, errBootstrapTimeout)
			e.log.Warn("no decoder asked for the room's kv within the bootstrap timeout, blocks freed",
				zap.String("request_id", rid), zap.Uint64("bootstrap_room", h.room.id), zap.Duration("bootstrap_timeout", e.cfg.BootstrapTimeout))
			continue
		}
		e.freeHeld(h, errLeaseExpired)
		e.log.Warn("kv lease expired before a decoder read it, blocks freed",
			zap.String("request_id", rid), zap.Duration("kv_lease", e.cfg.KVHoldTimeout))
	}
}

// schedule admits waiting requests in FIFO order while there is room; the
// head waits for blocks rather than being overtaken, like vLLM's FCFS policy.
func (e *Engine) schedule(now time.Time) {
	e.running = slices.DeleteFunc(e.running, func(r *request) bool { return !r.isLive() })
	e.waiting = slices.DeleteFunc(e.waiting, func(r *request) bool { return r.state != stateWaiting })
	admitted := 0
	for _, r := range e.waiting {
		if len(e.running) >= e.cfg.MaxRunning {
			break
		}
		// A decode that pulls its prompt's KV takes what its GPU cache lacks from
		// the prefiller; every other request reloads what the CPU tier holds.
		blocks, hit, reloaded, ok := e.pool.alloc(r.needBlocks, r.seq, r.lookupHashes(e.cfg.BlockSize), !r.readsKV())
		if !ok {
			break
		}
		admitted++
		r.blocks = blocks
		if r.blockHashes != nil {
			r.reloadedBlocks = reloaded
			r.cachedTokens = (hit + reloaded) * e.cfg.BlockSize
			e.counts.prefixQueries += r.promptTokens
			e.counts.prefixHits += hit * e.cfg.BlockSize
			if !r.readsKV() {
				e.counts.computed += r.promptTokens - r.cachedTokens
				if e.cfg.CPUOffloadBlocks > 0 {
					e.counts.externalQueries += r.promptTokens
					e.counts.externalHits += reloaded * e.cfg.BlockSize
				}
			}
		}
		e.running = append(e.running, r)
		if r.kind == kindDecode {
			r.state = statePulling
			if r.readsKV() {
				// The blocks this engine's cache holds are not pulled; the
				// remote blocks line up with the prompt's, one per block.
				r.pullFrom = min(r.cachedTokens/e.cfg.BlockSize, len(r.remote.RemoteBlockIDs))
				// The worker handshakes with a new prefiller when it first
				// needs to read from it, and that takes seconds (vLLM
				// #46240): the request waits for it, blocks allocated, as
				// WAITING_FOR_REMOTE_KVS; an abort then is an abort during
				// the transfer.
				if done := e.handshake(peerOf(r.remote), now); now.Before(done) {
					r.handshaking, r.readyAt = true, done
					continue
				}
			}
			r.push(output{kind: outPull, pullFrom: r.pullFrom})
			continue
		}
		r.state = statePrefilling
		r.readyAt = e.prefillDone(now, e.cfg.PrefillTime+e.computeTime(r))
	}
	e.waiting = e.waiting[admitted:]
}

// prefillDone is when a prefill of cost d admitted at now has computed. With
// MaxNumBatchedTokens the engine's compute is one, shared as vLLM's scheduler
// shares a step's token budget: prefills compute one after another in arrival
// order, so two at once take about twice as long as one (a prefill aborted
// meanwhile still delays those after it, as the chunks it computed did).
// Without it each prefill computes on its own, however many run.
func (e *Engine) prefillDone(now time.Time, d time.Duration) time.Time {
	if e.cfg.MaxNumBatchedTokens <= 0 {
		return now.Add(d)
	}
	start := now
	if e.computeFree.After(now) {
		start = e.computeFree
	}
	e.computeFree = start.Add(d)
	return e.computeFree
}

// itl is the time to a decoding request's next token at now. With
// MaxNumBatchedTokens a step carries every running decode's token and, while a
// prefill computes, a chunk of up to that many of its tokens, each at
// PrefillPerToken: decodes slow as more sequences run and while prompts are
// computed beside them.
func (e *Engine) itl(now time.Time) time.Duration {
	if e.cfg.MaxNumBatchedTokens <= 0 {
		return e.cfg.ITL
	}
	tokens := e.decoding
	if e.computeFree.After(now) {
		tokens += e.cfg.MaxNumBatchedTokens
	}
	return e.cfg.ITL + time.Duration(tokens)*e.cfg.PrefillPerToken
}

// advance orders the pulls whose handshake is done and emits at most one
// token per due request.
func (e *Engine) advance(now time.Time) {
	e.decoding = 0
	for _, r := range e.running {
		if r.state == stateDecoding {
			e.decoding++
		}
	}
	for _, r := range e.running {
		if r.handshaking && r.state == statePulling && !now.Before(r.readyAt) {
			r.handshaking = false
			r.push(output{kind: outPull, pullFrom: r.pullFrom})
			continue
		}
		if (r.state != statePrefilling && r.state != stateDecoding) || now.Before(r.readyAt) {
			continue
		}
		if r.state == statePrefilling {
			e.cachePrompt(r) // its prompt is computed
		}
		r.state = stateDecoding
		e.emit(r, now)
	}
	e.running = slices.DeleteFunc(e.running, func(r *request) bool { return !r.isLive() })
}

func (e *Engine) emit(r *request, now time.Time) {
	i := r.generated
	r.generated++
	o := output{kind: outToken, index: i, complete: r.generated, cached: r.cachedTokens}
	id, eos := r.nextToken(i)
	o.id = id
	switch {
	case eos:
		o.id = tokenEOS
		o.finish = "stop" // the EOS token counts but has no text
	case r.generated >= r.maxTokens:
		o.finish = "length"
		o.text = tokenWord(id)
	default:
		o.text = tokenWord(id)
		r.readyAt = now.Add(e.itl(now))
		r.push(o)
		return
	}
	if r.kind == kindPrefill {
		// Since 2026 vLLM's NixlConnector holds a prefill that stopped on EOS
		// or a stop string (FINISHED_STOPPED) as it holds a length-capped one:
		// before, it freed at once and answered kv_transfer_params null, and
		// the decoder recomputed the prompt.
		r.state = stateHeld
		r.expiresAt = now.Add(e.cfg.KVHoldTimeout)
		if r.room != nil {
			r.expiresAt = e.roomHeld(r)
		}
		if r.xfer != nil {
			r.xfer.signal() // wakes the decoders waiting in a claim
			if r.xfer.released && !r.xfer.claimed {
				e.freeReleasedLocked(r.xfer) // its decode ended while it prefilled
			}
		}
		if !r.expiresAt.IsZero() && (e.holdDue.IsZero() || r.expiresAt.Before(e.holdDue)) {
			e.holdDue = r.expiresAt
		}
		delete(e.live, r.rid)
		e.held[r.rid] = r
		e.counts.holds++
		o.held = append([]int{}, r.blocks...)
		o.leaseEnd = r.expiresAt
		r.push(o)
		if ce := e.log.Check(zap.DebugLevel, "prefill holds kv blocks for a decoder"); ce != nil {
			ce.Write(zap.String("request_id", r.rid), zap.Int("blocks", len(r.blocks)), zap.Time("expires_at", r.expiresAt))
		}
		return
	}
	if ce := e.log.Check(zap.DebugLevel, "request finished"); ce != nil {
		ce.Write(zap.String("request_id", r.rid), zap.Stringer("kind", r.kind), zap.String("finish_reason", o.finish), zap.Int("tokens", r.generated))
	}
	e.endLive(r, o)
}

func (e *Engine) nextDue() (next time.Time, ok bool) {
	consider := func(t time.Time) {
		if !ok || t.Before(next) {
			next, ok = t, true
		}
	}
	for _, r := range e.running {
		if r.state == statePrefilling || r.state == stateDecoding || r.handshaking {
			consider(r.readyAt)
		}
	}
	if !e.holdDue.IsZero() {
		// May be a hold freed since by a read: the wake-up then finds nothing.
		consider(e.holdDue)
	}
	return next, ok
}

// shutdown ends everything when Run stops: pending adds are refused, live
// requests aborted, holds freed, so the pool is whole again.
func (e *Engine) shutdown() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	stopped := errStopped
	for r, cancel := range e.prealloc {
		cancel(errStopped)
		delete(e.prealloc, r)
	}
	for _, ev := range e.inbox {
		if ev.kind == evAdd {
			ev.req.state = stateDone
			ev.req.push(output{kind: outEnd, err: stopped})
		}
	}
	e.inbox = nil
	for _, r := range e.live {
		e.endLive(r, output{kind: outEnd, err: stopped})
		e.counts.aborted++
	}
	for _, h := range e.held {
		e.freeHeld(h, stopped)
		e.counts.aborted++
	}
	for _, rm := range e.rooms {
		e.closeRoom(rm) // rooms only decoders asked for
	}
	for _, t := range e.transfers {
		e.closeTransfer(t) // transfers only decoders asked for
	}
	e.waiting, e.running = nil, nil
	e.holdDue = time.Time{}
	e.publishEvents(e.clock.Now())
}

// rankStats is this rank's part of Stats, without Ranks.
func (e *Engine) rankStats() KVStats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := KVStats{
		BlocksTotal:                     e.pool.total(),
		BlocksFree:                      e.pool.available(),
		CachedBlocks:                    e.pool.cachedBlocks(),
		PrefixCacheQueriesTotal:         e.counts.prefixQueries,
		PrefixCacheHitsTotal:            e.counts.prefixHits,
		KVBlocksPulledTotal:             e.counts.pulledBlocks,
		PromptTokensComputedTotal:       e.counts.computed,
		ExternalPrefixCacheQueriesTotal: e.counts.externalQueries,
		ExternalPrefixCacheHitsTotal:    e.counts.externalHits,
		CPUBlocksTotal:                  e.cfg.CPUOffloadBlocks,
		CPUCachedBlocks:                 e.pool.cpuCachedBlocks(),
		HeldRequests:                    len(e.held),
		RequestsTotal:                   e.counts.requests,
		AbortedTotal:                    e.counts.aborted,
		ExpiredTotal:                    e.counts.expired,
		LateEventsTotal:                 e.counts.lateEvents,
		DoubleFreeAttemptsTotal:         e.counts.doubleFrees,
		HeartbeatsTotal:                 e.counts.heartbeats,
		HeartbeatsSentTotal:             e.counts.heartbeatsSent,
		EngineCrashesTotal:              e.counts.crashes,
		HoldsTotal:                      e.counts.holds,
		KVLoadFailuresTotal:             e.counts.loadFailures,
		RemotePrefillRequestsTotal:      e.counts.remotePrefills,
		PoolingRequestsTotal:            e.counts.pooling,
		PoolingAbortedTotal:             e.counts.poolingAborted,
		Priorities:                      make(map[string]int, len(e.counts.priorities)),
	}
	for p, n := range e.counts.priorities {
		s.Priorities[strconv.Itoa(p)] = n
	}
	// Blocks are shared where prompts share a cached prefix: each counts
	// once, as held if a hold references it, so that free + in use + held
	// is the pool.
	held := make(map[int]struct{})
	for _, h := range e.held {
		for _, id := range h.blocks {
			held[id] = struct{}{}
		}
		if h.room != nil && !h.room.transferring {
			s.RoomsHeld++
		}
	}
	s.BlocksHeld = len(held)
	s.BlocksInUse = s.BlocksTotal - s.BlocksFree - s.BlocksHeld
	if e.cfg.Protocol == ProtocolMooncake {
		s.TransfersWaiting = len(e.prealloc)
	} else {
		s.RoomsWaiting = len(e.prealloc)
	}
	for _, r := range e.live {
		if r.state == stateWaiting {
			s.WaitingRequests++
		} else {
			s.RunningRequests++
		}
	}
	for _, ev := range e.inbox {
		if ev.kind == evAdd {
			// Submitted, not yet admitted by a step: queued as far as anyone
			// asking the engine can tell.
			s.WaitingRequests++
		}
	}
	return s
}
