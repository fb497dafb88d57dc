package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"

	"go.uber.org/zap"
)

// vLLM's MooncakeConnector (Config.Protocol "mooncake"), as vLLM's
// mooncake_connector_proxy.py and llm-d-router's connector_mooncake.go drive it: the
// client's body goes to a prefiller and a decoder at once, paired by a transfer_id the
// proxy makes.
//
// The prefiller (Role "prefill") runs a bootstrap server (BootstrapPort, default 8998)
// whose GET /query answers, per data parallel rank, {"<rank>": {"engine_id", "host",
// "port", "dp_rank", "tp_size"}}. Its prefill leg carries kv_transfer_params
// {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": ".."} and the
// header X-data-parallel-rank choosing the rank: the rank computes the prompt and one
// token whatever max_tokens says, answers the leg at once (as the vllm protocol does)
// and holds the blocks under the transfer_id until a decoder has pulled them, or for
// KVHoldTimeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480s; no heartbeats renew it). A
// prefill leg cut before its prefill is done aborts it: nothing is held.
//
// The decoder (Role "decode") takes kv_transfer_params {"do_remote_prefill": true,
// "do_remote_decode": false, "remote_bootstrap_addr": "http://P:port",
// "remote_engine_id", "remote_dp_rank", "transfer_id"}. It asks the prefiller's bootstrap
// server for the transfer's KV, waiting there for the prefill when it has not finished
// (TransfersWaiting; up to WaitingTimeout), then queues for its own blocks, pulls those
// its prefix cache lacks (KVTransferTime each), notifies and decodes as a vLLM decode. A
// decode whose transfer the prefiller cannot give (unknown past the waiting timeout,
// expired, aborted, pulled already, another engine id, bootstrap server unreachable) is
// logged and counted (KVLoadFailuresTotal) and then, as vLLM's kv_load_failure_policy
// says (Config.KVLoadFailurePolicy), fails with a 500 kv_transfer_failed ("fail", vLLM's
// default: config/kv_transfer.py) or computes the prompt itself ("recompute"; the client
// then sees a normal, slower answer). A prefiller remembers a transfer that ended for
// KVHoldTimeout, so a claim for it fails at once; one it never heard of waits the
// WaitingTimeout, the prefill leg being possibly still on its way. A decode leg cut before
// it pulled tells the prefiller (POST /mooncake/release), which frees the transfer's blocks
// at once, or as soon as its prefill holds them: vLLM's decoder, for a request aborted
// before its pull was scheduled, sends the prefiller the request with no blocks to read,
// and the prefiller frees it when its prefill is done. A release for a transfer the
// prefiller has not heard of is a no-op: that prefill holds until its timeout. Once a decode has the transfer it is a vLLM decode:
// ending before its pull still notifies the prefiller, and a pull of blocks no longer held
// fails with a 500 kv_transfer_failed.
//
// The bootstrap server's own calls, the sim's stand-in for Mooncake's ZMQ side channel:
//
//	POST /mooncake/claim {"transfer_id":"..","engine_id":"..","dp_rank":R}
//	  waits until the transfer's prefill on rank R holds its KV, then
//	  200 {"engine_id":"..","request_id":"..","block_ids":[..]}
//	  409  another decoder has it already
//	  410  its prefill ended without KV, or its hold ended (expired, pulled)
//	POST /mooncake/release {"transfer_id":"..","engine_id":"..","dp_rank":R}
//	  the decode ended without the KV: 200, and the blocks are freed
//	POST /kv/pull, POST /kv/notify   as in kvtransfer.go, to the rank of engine_id
//
// Older vLLM's decode params, bootstrap_server_host and bootstrap_server_port without a
// transfer_id, are a 400. There is no /abort_request in vLLM: an abort is a closed
// connection.

// Errors of the Mooncake protocol.
var errOldMooncake = badRequest("invalid_kv_transfer_params",
	"kv_transfer_params: bootstrap_server_host/bootstrap_server_port without transfer_id are older vLLM's MooncakeConnector params, "+
		"which the sim does not serve; send remote_bootstrap_addr, remote_engine_id, remote_dp_rank and transfer_id")

func (e *Engine) mooncake() bool { return e.cfg.Protocol == ProtocolMooncake }

// mooncakeRequest makes a the request the kv_transfer_params kv of a Mooncake leg ask for.
func (e *Engine) mooncakeRequest(kv *kvTransferParams, a *apiRequest) error {
	if kv == nil || (!kv.DoRemoteDecode && !kv.DoRemotePrefill) {
		return nil // served aggregated
	}
	if kv.DoRemoteDecode && kv.DoRemotePrefill {
		return badRequest("invalid_kv_transfer_params", "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
	}
	if kv.TransferID == "" {
		if kv.BootstrapServerHost != "" || kv.BootstrapServerPort != 0 {
			return errOldMooncake
		}
		return badRequest("invalid_kv_transfer_params", "kv_transfer_params: a mooncake leg needs transfer_id")
	}
	if len(a.prompts) != 1 || a.samples != 1 {
		return badRequest("invalid_n", "n=%d, best_of=%d, %d prompts: the sim serves one sample of one prompt per mooncake leg", a.n, a.samples, len(a.prompts))
	}
	if kv.DoRemoteDecode {
		if e.cfg.Role != "prefill" {
			return badRequest("invalid_kv_transfer_params", "kv_transfer_params: do_remote_decode sent to a mooncake %s engine", e.cfg.Role)
		}
		a.kind, a.maxTokens, a.minTokens, a.xferID = kindPrefill, 1, 0, kv.TransferID
		return nil
	}
	if e.cfg.Role != "decode" {
		return badRequest("invalid_kv_transfer_params", "kv_transfer_params: do_remote_prefill sent to a mooncake %s engine", e.cfg.Role)
	}
	u, err := url.Parse(kv.RemoteBootstrapAddr)
	var port int
	if err == nil {
		port, err = strconv.Atoi(u.Port())
	}
	if kv.RemoteBootstrapAddr == "" || err != nil || u.Scheme != "http" || u.Hostname() == "" || port <= 0 || port > 65535 {
		if kv.RemoteBootstrapAddr == "" && (kv.BootstrapServerHost != "" || kv.BootstrapServerPort != 0) {
			return errOldMooncake
		}
		return badRequest("invalid_kv_transfer_params", "kv_transfer_params: remote_bootstrap_addr %q: want http://host:port", kv.RemoteBootstrapAddr)
	}
	leg := &mooncakeLeg{host: u.Hostname(), port: port, engineID: kv.RemoteEngineID, transferID: kv.TransferID}
	if kv.RemoteDPRank != nil {
		leg.dpRank = *kv.RemoteDPRank
	}
	a.kind, a.mc = kindDecode, leg
	a.crashesDecoder = false // vLLM #50792 is the NixlConnector's
	return nil
}

func (e *Engine) transferOf(id string) *transfer {
	t := e.transfers[id]
	if t == nil {
		t = &transfer{id: id, ready: make(chan struct{})}
		e.transfers[id] = t
	}
	return t
}

// openTransfer registers the prefill r under its transfer_id; false if another prefill
// has it. At a step.
func (e *Engine) openTransfer(r *request) bool {
	t := e.transferOf(r.xferID)
	if t.prefill != nil {
		return false
	}
	delete(e.xferGone, r.xferID) // a transfer id used again is a new transfer
	t.prefill, r.xfer = r, t
	return true
}

// closeTransfer ends a transfer: waiters get a 410, and so does any claim for its id
// within the hold timeout.
func (e *Engine) closeTransfer(t *transfer) {
	if t.closed {
		return
	}
	t.closed = true
	t.signal()
	if e.transfers[t.id] == t {
		delete(e.transfers, t.id)
	}
	now := e.clock.Now()
	for id, until := range e.xferGone {
		if now.After(until) {
			delete(e.xferGone, id)
		}
	}
	e.xferGone[t.id] = now.Add(e.cfg.KVHoldTimeout)
}

// mooncakeClaim is the body of POST /mooncake/claim.
type mooncakeClaim struct {
	TransferID string `json:"transfer_id"`
	EngineID   string `json:"engine_id"`
	DPRank     int    `json:"dp_rank"`
}

// claimTransfer is the prefiller's side of a claim, on the rank that holds the
// transfer: it waits until the transfer's prefill holds its KV (or the transfer closes,
// or ctx ends) and hands it to one decoder.
func (e *Engine) claimTransfer(ctx context.Context, id string) (*claimResponse, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errStopped
	}
	if _, gone := e.xferGone[id]; gone && e.transfers[id] == nil {
		return nil, fmt.Errorf("transfer %q: %w", id, errKVNotHeld)
	}
	t := e.transferOf(id)
	t.waiters++
	defer func() {
		t.waiters--
		if t.prefill == nil && t.waiters == 0 && e.transfers[id] == t {
			delete(e.transfers, id) // nobody left who knows of it
		}
	}()
	for {
		switch {
		case t.closed:
			return nil, fmt.Errorf("transfer %q: %w", id, errKVNotHeld)
		case t.prefill != nil && t.prefill.state == stateHeld:
			if t.claimed {
				return nil, errRoomClaimed
			}
			t.claimed = true
			h := t.prefill
			return &claimResponse{EngineID: e.id, RequestID: h.rid, BlockIDs: slices.Clone(h.blocks)}, nil
		}
		ready := t.ready
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

// handleMooncakeRelease is a decoder's word that the decode of a transfer ended without its
// KV: {"transfer_id","engine_id","dp_rank"} as a claim. A transfer this engine never heard
// of is a no-op (vLLM's prefiller logs "not found"): its prefill, if it comes, holds until
// a decoder pulls it or its timeout.
func (e *Engine) handleMooncakeRelease(w http.ResponseWriter, r *http.Request) {
	var req mooncakeClaim
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil || req.TransferID == "" ||
		req.DPRank < 0 || req.DPRank >= len(e.ranks) {
		writeError(w, badRequest("invalid_release", `release needs a JSON body {"transfer_id":"..","engine_id":"..","dp_rank":<rank>}`))
		return
	}
	e.ranks[req.DPRank].releaseTransfer(req.TransferID)
	writeJSON(w, http.StatusOK, struct{}{})
}

// releaseTransfer frees a transfer's KV for a decode that ended without it: now when its
// prefill holds it, when it does otherwise.
func (e *Engine) releaseTransfer(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	t := e.transfers[id]
	if t == nil || t.prefill == nil || t.closed {
		return
	}
	t.released = true
	if t.prefill.state == stateHeld {
		// Claimed or not: a transfer has one decode leg, and its client left. A claim
		// whose answer the decoder lost as it gave up stands here too; and a drain leg
		// that claimed it only wanted it freed.
		e.freeReleasedLocked(t)
	}
}

// freeReleasedLocked ends a released transfer whose prefill holds its KV, as a decoder's
// notify would. e.mu is held.
func (e *Engine) freeReleasedLocked(t *transfer) {
	t.claimed = true // nobody pulls it now
	if e.enqueueLocked(event{kind: evFinishedSending, rid: t.prefill.rid}) == nil {
		e.wakeUp()
	}
}

// unclaim takes back a transfer's claim whose decoder never got the answer.
func (e *Engine) unclaim(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if t := e.transfers[id]; t != nil && t.claimed {
		t.claimed = false
		if t.released && t.prefill != nil && t.prefill.state == stateHeld {
			e.freeReleasedLocked(t)
		}
	}
}

// awaitTransfer is a Mooncake decode's wait for its prefill: it asks the prefiller's
// bootstrap server for the transfer's KV, then submits r to the scheduler, which
// allocates its blocks and orders the pull. When the prefiller cannot give the KV, r is
// submitted with nothing to pull and computes its prompt. It ends early when ctx ends
// (the client gone) or the engine stops.
func (e *Engine) awaitTransfer(ctx context.Context, r *request) error {
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// The timer starts before the request shows in transfers_waiting, so that a test
	// that sees it there and moves a fake clock moves this timer too.
	stop := e.after(e.cfg.WaitingTimeout, func() { cancel(errWaitingTimeout) })
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		stop()
		return errStopped
	}
	e.prealloc[r] = cancel
	e.mu.Unlock()

	ans, err := e.transport.claimTransfer(wctx, r.mc)
	stop()

	cause := context.Cause(wctx)
	switch {
	case wctx.Err() == nil:
	case errors.Is(cause, errStopped):
		err = errStopped
	case errors.Is(cause, errWaitingTimeout):
		err = errWaitingTimeout
	default:
		// The client left before this decoder pulled the KV. Like vLLM's decoder with a
		// request aborted before its pull was scheduled (it sends the prefiller the request
		// with no blocks to read), it tells the prefiller, which frees the transfer's blocks
		// now, or as soon as its prefill holds them. The request shows as waiting for its
		// transfer until the prefiller has been told, so that one seen gone has told it.
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
		if rerr := e.transport.releaseTransfer(rctx, r.mc); rerr != nil {
			e.log.Warn("mooncake release failed: the prefiller frees at its timeout",
				zap.String("request_id", r.rid), zap.String("transfer_id", r.mc.transferID), zap.Error(rerr))
		}
		rcancel()
		e.mu.Lock()
		delete(e.prealloc, r)
		e.mu.Unlock()
		return ctx.Err()
	}
	if errors.Is(err, errStopped) {
		return errStopped
	}
	e.mu.Lock()
	delete(e.prealloc, r)
	if err == nil {
		r.remote = &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: ans.BlockIDs, RemoteEngineID: ans.EngineID,
			RemoteRequestID: ans.RequestID, RemoteHost: r.mc.host, RemotePort: r.mc.port, TPSize: 1}
	} else {
		e.counts.loadFailures++
		recompute := e.cfg.KVLoadFailurePolicy == KVLoadFailureRecompute
		e.log.Warn("mooncake transfer not available from the prefiller",
			zap.String("request_id", r.rid), zap.String("transfer_id", r.mc.transferID),
			zap.String("bootstrap", net.JoinHostPort(r.mc.host, strconv.Itoa(r.mc.port))),
			zap.Bool("recompute", recompute), zap.Error(err))
		if !recompute {
			e.mu.Unlock()
			if errors.Is(err, errWaitingTimeout) {
				return statusError(http.StatusInternalServerError, "kv_transfer_failed",
					"no prefill for transfer_id %q came within the waiting timeout (%s)", r.mc.transferID, e.cfg.WaitingTimeout)
			}
			return statusError(http.StatusInternalServerError, "kv_transfer_failed",
				"the prefiller has no KV for transfer_id %q (unknown, expired, aborted or pulled already)", r.mc.transferID)
		}
	}
	err = e.enqueueLocked(event{kind: evAdd, req: r})
	e.mu.Unlock()
	if err == nil {
		e.wakeUp()
	}
	return err
}

// mooncakeInfo is one rank's entry in GET /query.
type mooncakeInfo struct {
	EngineID string `json:"engine_id"`
	Host     string `json:"host"`
	Port     int    `json:"port"`
	DPRank   int    `json:"dp_rank"`
	TPSize   int    `json:"tp_size"`
}

func (e *Engine) mooncakeBootstrapHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /query", e.handleQuery)
	mux.HandleFunc("POST /mooncake/claim", e.handleMooncakeClaim)
	mux.HandleFunc("POST /mooncake/release", e.handleMooncakeRelease)
	mux.HandleFunc("POST /kv/pull", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handlePull }))
	mux.HandleFunc("POST /kv/notify", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handleNotify }))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	return mux
}

// handleQuery is GET /query: each data parallel rank's engine id, keyed by the rank.
func (e *Engine) handleQuery(w http.ResponseWriter, r *http.Request) {
	host := e.cfg.BootstrapHost
	if a, ok := r.Context().Value(http.LocalAddrContextKey).(*net.TCPAddr); ok {
		host = a.IP.String() // what the caller reached, usable when bound to 0.0.0.0
	}
	out := make(map[string]mooncakeInfo, len(e.ranks))
	for _, rk := range e.ranks {
		out[strconv.Itoa(rk.rank)] = mooncakeInfo{EngineID: rk.id, Host: host, Port: e.boot.port(), DPRank: rk.rank, TPSize: 1}
	}
	writeJSON(w, http.StatusOK, out)
}

func (e *Engine) handleMooncakeClaim(w http.ResponseWriter, r *http.Request) {
	var req mooncakeClaim
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil || req.TransferID == "" {
		writeError(w, badRequest("invalid_claim", `claim needs a JSON body {"transfer_id":"..","engine_id":"..","dp_rank":<rank>}`))
		return
	}
	if req.DPRank < 0 || req.DPRank >= len(e.ranks) {
		writeError(w, badRequest("invalid_data_parallel_rank", "dp_rank %d: this server has data parallel ranks 0 to %d", req.DPRank, len(e.ranks)-1))
		return
	}
	rk := e.ranks[req.DPRank]
	if req.EngineID != "" && req.EngineID != rk.id {
		// The prefiller restarted under a new id, or the proxy mixed ranks: this engine
		// holds nothing of that one.
		writeError(w, statusError(http.StatusGone, "unknown_engine", "engine %q is not rank %d's engine (%q)", req.EngineID, req.DPRank, rk.id))
		return
	}
	ans, err := rk.claimTransfer(r.Context(), req.TransferID)
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, ans)
		if r.Context().Err() != nil {
			// The decoder went away as it was handed the transfer: the claim is taken
			// back, so that another decode leg (the proxy's drain) can pull and free it.
			rk.unclaim(req.TransferID)
		}
	case errors.Is(err, errKVNotHeld):
		writeError(w, statusError(http.StatusGone, "kv_not_held", "%v", err))
	case errors.Is(err, errRoomClaimed):
		writeError(w, statusError(http.StatusConflict, "transfer_claimed", "transfer %q: another decoder has it", req.TransferID))
	case r.Context().Err() != nil:
		// The decoder gave up: nobody reads an answer.
	default:
		writeError(w, err)
	}
}

// claimTransfer asks a Mooncake prefiller's bootstrap server for a transfer's KV.
func (t *httpTransport) releaseTransfer(ctx context.Context, leg *mooncakeLeg) error {
	body := mooncakeClaim{TransferID: leg.transferID, EngineID: leg.engineID, DPRank: leg.dpRank}
	var out struct{}
	return t.call(ctx, leg.host, leg.port, "/mooncake/release", body, &out)
}

func (t *httpTransport) claimTransfer(ctx context.Context, leg *mooncakeLeg) (*claimResponse, error) {
	var out claimResponse
	body := mooncakeClaim{TransferID: leg.transferID, EngineID: leg.engineID, DPRank: leg.dpRank}
	if err := t.call(ctx, leg.host, leg.port, "/mooncake/claim", body, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
