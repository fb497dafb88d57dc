package sim

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// SGLang's prefill/decode disaggregation (Config.Protocol "sglang"), as SGLang's mini_lb.py
// and model gateway drive it: the client's body goes to a prefiller and a decoder at once,
// both carrying the prefiller's bootstrap_host and bootstrap_port, a shared bootstrap_room
// and the same rid (for several prompts, an array of each, one entry per prompt). The
// decoder's answer goes to the client; the prefiller's is read and dropped.
//
// The prefiller (Role "prefill") runs a body with a bootstrap_room as a prefill of one
// token whatever max_tokens says, then holds its blocks in the room: no lease, no
// expiry (with NIXL SGLang holds a room nobody claims until it restarts) unless
// BootstrapTimeout is set. It answers its leg once the room's transfer has ended: a normal
// completion of that one token when the decoder read the KV (streaming: one chunk, then
// [DONE]), a 500 when the transfer failed or the bootstrap timeout freed the room,
// finish_reason "abort" when the room was aborted.
//
// The bootstrap server, the prefiller's second port (BootstrapPort, reported by
// GET /server_info as disaggregation_bootstrap_port), is the sim's own JSON over HTTP:
//
//	POST /bootstrap/claim {"room":R,"rid":".."}
//	  waits until room R's prefill holds its KV, then
//	  200 {"engine_id":"..","request_id":"..","block_ids":[..]}   the room's KV
//	  409  another decoder asked for the room already
//	  410  the room's prefill ended without KV (aborted, failed, freed)
//	  503  the engine is stopping
//	POST /kv/pull, POST /kv/notify   as in kvtransfer.go, with the request_id above
//
// A room the claim answered no longer has a bootstrap timeout. A pull starts its transfer:
// from then on an abort of the prefill answers its leg but leaves the blocks until the
// decoder's notification, which frees them (outcome "failed": the leg answers 500).
//
// The decoder (Role "decode") runs a body with a bootstrap_room as a decode that first
// waits for its room (the prealloc queue: KVStats.RoomsWaiting) by a claim to
// bootstrap_host:bootstrap_port, up to WaitingTimeout (then a 500 kv_transfer_timeout);
// a decode whose prefill leg never comes waits that long. Then it queues for its own
// blocks, pulls, notifies and decodes as a vLLM decode does. A decode that ends before
// its pull (aborted, client gone, timed out) tells the prefiller nothing, as with NIXL:
// the room stays held until the prefiller's own leg is aborted. One that ends during or
// after its pull does notify, so the room is freed. A failed claim (room gone, taken,
// bootstrap server unreachable) or pull fails the decode with a 500 kv_transfer_failed.
//
// POST /abort_request {"rid":"..","abort_all":false} answers 200 with an empty body. As
// SGLang's tokenizer manager, it acts only if a request with exactly that rid is in flight
// on this server (or abort_all); then, as SGLang's scheduler, it aborts every request
// whose rid starts with it: the rooms waited for, queued, pulling and decoding requests,
// and held rooms whose transfer has not started (freed, the leg answered "abort"). An
// abort that finds nothing is a late event. A client that disconnects is aborted
// DisconnectDelay later (SGLang notices a closed connection late), so an explicit abort is
// what frees things promptly. The rid comes from the body's rid (X-Request-Id is not read);
// without one the sim makes one up.
//
// A body without a bootstrap_room is served aggregated, on either role. kv_transfer_params
// are ignored. n > 1 and best_of with a bootstrap_room are a 400.

// parseSGLang reads the rid and bootstrap fields of a body of prompts prompts: each a
// value for one prompt or an array with one entry per prompt. A decoder needs the host and
// port with a room; a prefiller ignores them.
func parseSGLang(w *wireRequest, prompts int, role string) (*sglangFields, error) {
	var (
		f   sglangFields
		err error
	)
	if f.rids, err = perPrompt[string](w.RID, prompts, "rid"); err != nil {
		return nil, err
	}
	if slices.Contains(f.rids, "") {
		return nil, badRequest("invalid_rid", "rid: must not be empty")
	}
	if f.rooms, err = perPrompt[uint64](w.BootstrapRoom, prompts, "bootstrap_room"); err != nil {
		return nil, err
	}
	for i, r := range f.rooms {
		if r >= 1<<63 {
			return nil, badRequest("invalid_bootstrap_room", "bootstrap_room %d: must be below 2^63", r)
		}
		if slices.Index(f.rooms, r) != i {
			return nil, badRequest("invalid_bootstrap_room", "bootstrap_room %d: given for two prompts", r)
		}
	}
	if f.rooms == nil || role != "decode" {
		return &f, nil
	}
	if f.hosts, err = perPrompt[string](w.BootstrapHost, prompts, "bootstrap_host"); err != nil {
		return nil, err
	}
	if f.ports, err = perPrompt[int](w.BootstrapPort, prompts, "bootstrap_port"); err != nil {
		return nil, err
	}
	if f.hosts == nil || f.ports == nil || slices.Contains(f.hosts, "") {
		return nil, badRequest("invalid_bootstrap", "a decode with bootstrap_room needs bootstrap_host and bootstrap_port")
	}
	for _, p := range f.ports {
		if p <= 0 || p > 65535 {
			return nil, badRequest("invalid_bootstrap", "bootstrap_port %d: not a port", p)
		}
	}
	return &f, nil
}

// perPrompt decodes raw as one T for a single prompt or an array of n; nil when absent.
func perPrompt[T any](raw json.RawMessage, n int, name string) ([]T, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, nil
	}
	if raw[0] == '[' {
		var vs []T
		if err := json.Unmarshal(raw, &vs); err != nil {
			return nil, badRequest("invalid_"+name, "%s: %v", name, err)
		}
		if len(vs) != n {
			return nil, badRequest("invalid_"+name, "%s: %d entries for %d prompts", name, len(vs), n)
		}
		return vs, nil
	}
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, badRequest("invalid_"+name, "%s: %v", name, err)
	}
	if n != 1 {
		return nil, badRequest("invalid_"+name, "%s: one value for %d prompts; want an array with one per prompt", name, n)
	}
	return []T{v}, nil
}

func (e *Engine) sglang() bool { return e.cfg.Protocol == ProtocolSGLang }

// sglangRequest makes a the request SGLang's protocol asks for and returns its rid.
func (e *Engine) sglangRequest(wb *wireBody, a *apiRequest) (string, error) {
	f, err := parseSGLang(&wb.wireRequest, len(a.prompts), e.cfg.Role)
	if err != nil {
		return "", err
	}
	a.sg = f
	a.crashesDecoder = false // vLLM's bug (#50792), not SGLang's
	rid := newRequestID()
	if f.rids != nil {
		rid = f.rids[0]
	}
	if f.rooms == nil {
		return rid, nil
	}
	if a.samples != 1 {
		return "", badRequest("invalid_n", "n=%d, best_of=%d: the sim serves one sample per prompt with bootstrap_room", a.n, a.samples)
	}
	if n := uint64(e.cfg.DataParallelSize); n > 1 && e.cfg.Role == "prefill" {
		for _, room := range f.rooms {
			if room%n != uint64(e.rank) {
				return "", badRequest("invalid_bootstrap_room", "bootstrap_room %d belongs to data parallel rank %d (room %% %d), not rank %d: send it with %s: %d",
					room, room%n, n, e.rank, HeaderDataParallelRank, room%n)
			}
		}
	}
	if e.cfg.Role == "prefill" {
		// The prefill leg computes the prompt and its first token, whatever
		// max_tokens says: the proxy sends both legs the client's body.
		a.kind, a.maxTokens, a.minTokens = kindPrefill, 1, 0
	} else {
		a.kind = kindDecode
	}
	return rid, nil
}

// Errors of the SGLang protocol.
var (
	errWaitingTimeout = statusError(http.StatusInternalServerError, "kv_transfer_timeout",
		"no KV came for the bootstrap room within the waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
	errBootstrapTimeout = statusError(http.StatusInternalServerError, "bootstrap_timeout",
		"no decoder asked for the bootstrap room's KV within the bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
	errTransferFailed = statusError(http.StatusInternalServerError, "kv_transfer_failed",
		"the decoder reported that the KV transfer failed")
	// errLeaseExpired ends a vLLM hold whose lease ran out; nobody answers with it.
	errLeaseExpired = errors.New("kv lease expired")
	errRoomGone     = fmt.Errorf("bootstrap room: %w", errKVNotHeld)
	errRoomClaimed  = errors.New("bootstrap room already asked for by another decoder")
)

// transferOutcome is what a prefill's leg answers for a decoder's notify outcome.
func transferOutcome(outcome string) error {
	if outcome == outcomeFailed {
		return errTransferFailed
	}
	return nil
}

func (e *Engine) roomOf(id uint64) *room {
	rm := e.rooms[id]
	if rm == nil {
		rm = &room{id: id, ready: make(chan struct{})}
		e.rooms[id] = rm
	}
	return rm
}

// openRoom puts the prefill r in its room; false if another prefill has it. At a step.
func (e *Engine) openRoom(r *request) bool {
	rm := e.roomOf(r.leg.room)
	if rm.prefill != nil {
		return false
	}
	rm.prefill, r.room = r, rm
	return true
}

// roomHeld wakes the decoders waiting for r's room, whose prefill now holds its KV, and
// returns when the hold ends by itself: after BootstrapTimeout, or never (zero).
func (e *Engine) roomHeld(r *request) time.Time {
	r.room.signal()
	if e.cfg.BootstrapTimeout > 0 && !r.room.bootstrapped {
		return r.arrived.Add(e.cfg.BootstrapTimeout)
	}
	return time.Time{}
}

// closeRoom ends a room: waiters get a 410, a later claim of its id waits for a new one.
func (e *Engine) closeRoom(rm *room) {
	if rm.closed {
		return
	}
	rm.closed = true
	rm.signal()
	if e.rooms[rm.id] == rm {
		delete(e.rooms, rm.id)
	}
}

// abortRoom aborts the held prefill h of a room. Before its transfer started it frees the
// blocks; during it, it answers the leg and the decoder's notification frees them.
func (e *Engine) abortRoom(h *request) {
	if !h.room.transferring {
		e.freeHeld(h, errAborted)
		e.counts.aborted++
		return
	}
	if h.legEnded {
		e.late("abort of a room whose leg was answered already ignored", h.rid, h.state)
		return
	}
	h.legEnded = true
	h.push(output{kind: outReleased, err: errAborted})
	e.counts.aborted++
	e.log.Info("abort of a room being transferred: leg answered, blocks freed when the decoder's transfer ends",
		zap.String("request_id", h.rid), zap.Uint64("bootstrap_room", h.room.id))
}

// abortPrefix applies an SGLang abort at a step: every live or held request whose rid
// starts with ev.rid (every one with ev.all).
func (e *Engine) abortPrefix(ev event) {
	found := ev.matched
	match := func(rid string) bool { return ev.all || strings.HasPrefix(rid, ev.rid) }
	for rid, r := range e.live {
		if match(rid) {
			e.endLive(r, output{kind: outEnd, err: errAborted})
			e.counts.aborted++
			found = true
		}
	}
	for rid, h := range e.held {
		if !match(rid) {
			continue
		}
		found = true
		if h.room != nil {
			e.abortRoom(h)
			continue
		}
		e.freeHeld(h, errAborted)
		e.counts.aborted++
	}
	if !found {
		e.late("abort matched no request ignored", ev.rid, stateDone)
	}
}

// abortSGLang is POST /abort_request on an SGLang engine. The rooms waited for are ended
// here, under the lock that also queues the step's part, so that an abort racing a
// decode's move from its wait to the queue finds it in one place or the other.
func (e *Engine) abortSGLang(rid string, all bool) {
	e.mu.Lock()
	if !all && e.inflight[rid] == 0 {
		// SGLang's tokenizer manager drops an abort whose rid it is not serving
		// (`if not abort_all and rid not in self.rid_to_state: return`).
		e.late("abort of a rid not in flight ignored", rid, stateDone)
		e.mu.Unlock()
		return
	}
	matched := false
	for r, cancel := range e.prealloc {
		if all || strings.HasPrefix(r.rid, rid) {
			cancel(errAborted)
			delete(e.prealloc, r)
			e.counts.aborted++
			matched = true
		}
	}
	_ = e.enqueueLocked(event{kind: evAbortRID, rid: rid, prefix: true, all: all, matched: matched})
	e.mu.Unlock()
	e.wakeUp()
}

// track records rids as in flight at the HTTP layer until the returned func is called.
func (e *Engine) track(rids []string) (untrack func()) {
	e.mu.Lock()
	for _, rid := range rids {
		e.inflight[rid]++
	}
	e.mu.Unlock()
	return func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, rid := range rids {
			if e.inflight[rid]--; e.inflight[rid] <= 0 {
				delete(e.inflight, rid)
			}
		}
	}
}

// claimRequest and claimResponse are the bootstrap server's claim.
type claimRequest struct {
	Room uint64 `json:"room"`
	RID  string `json:"rid"`
}

type claimResponse struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	BlockIDs  []int  `json:"block_ids"`
}

// claimRoom is the prefiller's side of a claim: it waits until room id's prefill holds its
// KV (or the room closes, or ctx ends) and hands it to the decoder once.
func (e *Engine) claimRoom(ctx context.Context, id uint64) (*claimResponse, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errStopped
	}
	rm := e.roomOf(id)
	rm.waiters++
	defer func() {
		rm.waiters--
		if rm.prefill == nil && rm.waiters == 0 && e.rooms[id] == rm {
			delete(e.rooms, id) // nobody left who knows of it
		}
	}()
	for {
		switch {
		case rm.closed:
			return nil, errRoomGone
		case rm.prefill != nil && rm.prefill.state == stateHeld:
			if rm.bootstrapped {
				return nil, errRoomClaimed
			}
			rm.bootstrapped = true
			h := rm.prefill
			h.expiresAt = time.Time{} // no bootstrap timeout once a decoder has it
			return &claimResponse{EngineID: e.id, RequestID: h.rid, BlockIDs: slices.Clone(h.blocks)}, nil
		}
		ready := rm.ready
		e.mu.Unlock()
		select {
		case <-ready:
		case <-ctx.Done():
		}
		e.mu.Lock()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
}

// awaitRoom is a decode's wait for its room (SGLang's prealloc queue): it asks the
// prefiller's bootstrap server for the room's KV, then submits r to the scheduler, which
// allocates its blocks and orders the pull. It ends early on an abort, the waiting
// timeout, ctx (the client gone, after the disconnect delay) or the engine's shutdown.
func (e *Engine) awaitRoom(ctx context.Context, r *request) error {
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// The timer starts before the request shows in rooms_waiting, so that a
	// test that sees it there and moves a fake clock moves this timer too.
	stop := e.after(e.cfg.WaitingTimeout, func() { cancel(errWaitingTimeout) })
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		stop()
		return errStopped
	}
	e.prealloc[r] = cancel
	e.mu.Unlock()

	ans, err := e.transport.claim(wctx, r.leg, r.rid)
	stop()

	e.mu.Lock()
	delete(e.prealloc, r)
	if err == nil && wctx.Err() == nil {
		r.remote = &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: ans.BlockIDs, RemoteEngineID: ans.EngineID,
			RemoteRequestID: ans.RequestID, RemoteHost: r.leg.host, RemotePort: r.leg.port, TPSize: 1}
		err = e.enqueueLocked(event{kind: evAdd, req: r})
		e.mu.Unlock()
		if err == nil {
			e.wakeUp()
		}
		return err
	}
	e.mu.Unlock()
	// A room the claim got but this request no longer wants stays held on the prefiller
	// (no transfer started): as with NIXL, only the prefiller's own abort frees it.
	switch cause := context.Cause(wctx); {
	case wctx.Err() == nil:
	case errors.Is(cause, errAborted), errors.Is(cause, errStopped):
		return cause
	case errors.Is(cause, errWaitingTimeout):
		e.log.Warn("decode waited for its bootstrap room past the waiting timeout",
			zap.String("request_id", r.rid), zap.Uint64("bootstrap_room", r.leg.room), zap.Duration("waiting_timeout", e.cfg.WaitingTimeout))
		return errWaitingTimeout
	default:
		return ctx.Err() // the client is gone
	}
	e.log.Warn("bootstrap failed", zap.String("request_id", r.rid), zap.Uint64("bootstrap_room", r.leg.room), zap.Error(err))
	switch {
	case errors.Is(err, errKVNotHeld):
		return statusError(http.StatusInternalServerError, "kv_transfer_failed", "the prefill of bootstrap room %d ended without KV", r.leg.room)
	case errors.Is(err, errRoomClaimed):
		return statusError(http.StatusInternalServerError, "kv_transfer_failed", "bootstrap room %d was taken by another decoder", r.leg.room)
	}
	return statusError(http.StatusInternalServerError, "kv_transfer_failed", "bootstrap with %s failed", net.JoinHostPort(r.leg.host, strconv.Itoa(r.leg.port)))
}

// after calls f once d has passed on the engine's clock, unless the returned stop is
// called first; stop returns once f is done or will never run.
func (e *Engine) after(d time.Duration, f func()) (stop func()) {
	t := e.clock.NewTimer(d)
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-t.C():
			f()
		case <-quit:
		}
	}()
	return func() {
		t.Stop()
		close(quit)
		<-done
	}
}

// lingering returns the context an SGLang request is served under: it ends
// DisconnectDelay after ctx does, as SGLang notices a gone client late. stop, called
// when the handler returns, ends it and waits for its timer.
func (e *Engine) lingering(ctx context.Context) (work context.Context, stop func()) {
	if !e.sglang() || e.cfg.DisconnectDelay <= 0 {
		return ctx, func() {}
	}
	work, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	done := make(chan struct{})
	stopAfter := context.AfterFunc(ctx, func() {
		defer close(done)
		if sleep(work, e.clock, e.cfg.DisconnectDelay) == nil {
			cancel(context.Cause(ctx))
		}
	})
	return work, func() {
		cancel(nil)
		if !stopAfter() {
			<-done
		}
	}
}

// bootstrapServer is an SGLang prefiller's bootstrap server: its own listener, bound by
// New so that /server_info can report the port, served by Run.
type bootstrapServer struct {
	ln  net.Listener
	srv *http.Server
}

func listenBootstrap(host string, port int) (*bootstrapServer, error) {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("sim: bootstrap server: listen %s: %w", addr, err)
	}
	return &bootstrapServer{ln: ln, srv: &http.Server{ReadHeaderTimeout: 10 * time.Second}}, nil
}

func (b *bootstrapServer) port() int { return b.ln.Addr().(*net.TCPAddr).Port }

// bootstrapGrace bounds the wait for the bootstrap server's handlers when Run ends; they
// return at once, the rooms being closed by then.
const bootstrapGrace = 5 * time.Second

// serve serves the bootstrap server until stop, which closes it and waits.
func (b *bootstrapServer) serve(log *zap.Logger) (stop func()) {
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := b.srv.Serve(b.ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("bootstrap server stopped", zap.Error(err))
		}
	})
	log.Info("bootstrap server listening", zap.String("addr", b.ln.Addr().String()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), bootstrapGrace)
		defer cancel()
		if err := b.srv.Shutdown(ctx); err != nil {
			_ = b.srv.Close()
		}
		wg.Wait()
	}
}

func (e *Engine) bootstrapHandler() http.Handler {
	if e.mooncake() {
		return e.mooncakeBootstrapHandler()
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /bootstrap/claim", e.handleClaim)
	mux.HandleFunc("POST /kv/pull", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handlePull }))
	mux.HandleFunc("POST /kv/notify", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handleNotify }))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	return mux
}

func (e *Engine) handleClaim(w http.ResponseWriter, r *http.Request) {
	var req claimRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil {
		writeError(w, badRequest("invalid_claim", `claim needs a JSON body {"room":<bootstrap room>,"rid":".."}`))
		return
	}
	// With data parallel ranks a room belongs to rank room % size, as SGLang's decoder
	// picks its prefiller's rank (bootstrap_room % prefill dp size).
	ans, err := e.ranks[req.Room%uint64(len(e.ranks))].claimRoom(r.Context(), req.Room)
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, ans)
	case errors.Is(err, errRoomGone):
		writeError(w, statusError(http.StatusGone, "room_gone", "bootstrap room %d: its prefill ended without KV", req.Room))
	case errors.Is(err, errRoomClaimed):
		writeError(w, statusError(http.StatusConflict, "room_claimed", "bootstrap room %d: %v", req.Room, err))
	case r.Context().Err() != nil:
		// The decoder gave up: nobody reads an answer.
	default:
		writeError(w, err)
	}
}

// handleServerInfo is GET /server_info (and /get_server_info, its older name): the few
// server arguments a router reads.
func (e *Engine) handleServerInfo(w http.ResponseWriter, _ *http.Request) {
	info := map[string]any{
		"model_path":                      e.defaultModel(),
		"served_model_name":               e.defaultModel(),
		"disaggregation_mode":             "null",
		"disaggregation_transfer_backend": "nixl",
	}
	if e.sglang() {
		info["disaggregation_mode"] = e.cfg.Role
	}
	if e.boot != nil {
		info["disaggregation_bootstrap_port"] = e.boot.port()
	}
	writeJSON(w, http.StatusOK, info)
}

// adminAuthorized checks the admin key of an admin call, when the engine has one.
func (e *Engine) adminAuthorized(r *http.Request) bool {
	if e.cfg.AdminAPIKey == "" {
		return true
	}
	got := []byte(r.Header.Get("Authorization"))
	return subtle.ConstantTimeCompare(got, []byte("Bearer "+e.cfg.AdminAPIKey)) == 1
}
