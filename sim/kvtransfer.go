package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// The pull/notify protocol, the sim's stand-in for a NIXL READ and its
// completion notification. Both calls go from the decoder to the prefiller
// named by kv_transfer_params (remote_host:remote_port):
//
//	POST /kv/pull   {"engine_id":"..","request_id":"..","block_ids":[..]}
//	  200 {"blocks":N}                 the blocks are held for that request: read done
//	                                   (block_ids: those the decoder's own prefix
//	                                   cache lacks, possibly none)
//	  410 {"error":{..,"code":"kv_not_held"}}  no such hold (expired, aborted, freed)
//	POST /kv/notify {"engine_id":"..","request_id":"..","outcome":".."}
//	  200 {}                           queued as finished_sending for the next step;
//	                                   outcome (SGLang only) "failed": the transfer
//	                                   failed, the prefiller answers its leg 500
//	POST /kv/heartbeat {"engine_id":"..","request_ids":[".."]}
//	  200 {}                           queued lease renewals (see heartbeat.go)
//
// A call naming another engine_id is a 404 (unknown_engine): the prefiller
// restarted under a new id and holds nothing of the old one.
//
// The decoder spends KVTransferTime per block it pulls before its pull, so a hold
// that expires during the transfer fails the pull: race R4 surfaces as a
// failed decode, never as a 200 with stale output.

// errKVNotHeld means the prefiller no longer holds the blocks a decoder asked for.
var errKVNotHeld = errors.New("kv blocks are no longer held by the prefiller")

// errInjectedTransfer is the X-Sim-Transfer-Fail fault.
var errInjectedTransfer = errors.New("kv transfer failed (injected fault)")

// outcomeFailed is the notify outcome of an SGLang transfer that failed.
const outcomeFailed = "failed"

// kvTransport carries a decoder's pull, notify and heartbeat to a prefiller.
type kvTransport interface {
	pull(ctx context.Context, p *kvTransferParams) error
	// notify tells the prefiller the decoder is done with the blocks;
	// outcome is "" or, for an SGLang transfer, outcomeFailed.
	notify(ctx context.Context, p *kvTransferParams, outcome string) error
	// heartbeat renews the leases of rids on the prefiller p names.
	heartbeat(ctx context.Context, p *kvTransferParams, rids []string) error
	// claim asks an SGLang prefiller's bootstrap server for the KV of a
	// room, waiting until the room's prefill holds it (sglang.go).
	claim(ctx context.Context, leg *sglangLeg, rid string) (*claimResponse, error)
	// claimTransfer asks a Mooncake prefiller's bootstrap server for the KV
	// of a transfer, waiting until its prefill holds it (mooncake.go).
	claimTransfer(ctx context.Context, leg *mooncakeLeg) (*claimResponse, error)
	// releaseTransfer tells a Mooncake prefiller that the decode of a transfer ended
	// without its KV, so that the prefiller frees it (mooncake.go).
	releaseTransfer(ctx context.Context, leg *mooncakeLeg) error
}

type pullRequest struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	BlockIDs  []int  `json:"block_ids"`
	Outcome   string `json:"outcome,omitempty"`
}

type heartbeatRequest struct {
	EngineID   string   `json:"engine_id"`
	RequestIDs []string `json:"request_ids"`
}

type pullResponse struct {
	Blocks int `json:"blocks"`
}

// notifyTimeout bounds a notification sent after the request's own context
// ended (abort path): it must still reach the prefiller, but not hang.
const notifyTimeout = 5 * time.Second

func newTransferClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     30 * time.Second,
	}}
}

// httpTransport speaks the protocol above over HTTP.
type httpTransport struct {
	client *http.Client
	// stopped reports that the engine's Run has ended. A handler may still
	// notify after that (its request ended by the shutdown); its connection
	// must not then sit idle with nobody left to close it.
	stopped func() bool
}

var _ kvTransport = (*httpTransport)(nil)

func (t *httpTransport) pull(ctx context.Context, p *kvTransferParams) error {
	return t.post(ctx, p, "/kv/pull", pullRequest{EngineID: p.RemoteEngineID, RequestID: p.RemoteRequestID, BlockIDs: p.RemoteBlockIDs})
}

func (t *httpTransport) notify(ctx context.Context, p *kvTransferParams, outcome string) error {
	return t.post(ctx, p, "/kv/notify", pullRequest{EngineID: p.RemoteEngineID, RequestID: p.RemoteRequestID, Outcome: outcome})
}

func (t *httpTransport) heartbeat(ctx context.Context, p *kvTransferParams, rids []string) error {
	return t.post(ctx, p, "/kv/heartbeat", heartbeatRequest{EngineID: p.RemoteEngineID, RequestIDs: rids})
}

func (t *httpTransport) claim(ctx context.Context, leg *sglangLeg, rid string) (*claimResponse, error) {
	var out claimResponse
	if err := t.call(ctx, leg.host, leg.port, "/bootstrap/claim", claimRequest{Room: leg.room, RID: rid}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

func (t *httpTransport) post(ctx context.Context, p *kvTransferParams, path string, body any) error {
	return t.call(ctx, p.RemoteHost, p.RemotePort, path, body, nil)
}

// call posts body to path on host:port and decodes a 200's body into out
// (unless nil). A 410 wraps errKVNotHeld, a 409 errRoomClaimed.
func (t *httpTransport) call(ctx context.Context, host string, port int, path string, body, out any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("encode %s: %w", path, err)
	}
	url := "http://" + net.JoinHostPort(host, strconv.Itoa(port)) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("build %s request: %w", path, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return fmt.Errorf("post %s: %w", url, err)
	}
	defer func() {
		resp.Body.Close()
		if t.stopped() {
			t.client.CloseIdleConnections()
		}
	}()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	switch {
	case resp.StatusCode == http.StatusGone:
		return fmt.Errorf("post %s: %w", url, errKVNotHeld)
	case resp.StatusCode == http.StatusConflict:
		return fmt.Errorf("post %s: %w", url, errRoomClaimed)
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("post %s: status %d: %s", url, resp.StatusCode, bytes.TrimSpace(msg))
	}
	if out != nil {
		if err := json.Unmarshal(msg, out); err != nil {
			return fmt.Errorf("post %s: decode answer: %w", url, err)
		}
	}
	return nil
}

// checkHeld is the prefiller's side of a pull: it succeeds only while rid
// holds exactly these blocks. Reading does not change scheduler state, so it
// does not wait for a step; it marks an SGLang room as transferring, which
// an abort no longer frees.
func (e *Engine) checkHeld(engineID, rid string, blocks []int) error {
	if engineID != "" && engineID != e.id {
		return fmt.Errorf("engine %q asked of engine %q: %w", engineID, e.id, errKVNotHeld)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	h, ok := e.held[rid]
	if !ok {
		return fmt.Errorf("request %q: %w", rid, errKVNotHeld)
	}
	// A decoder reads the blocks its own prefix cache lacks: any of the
	// hold's, none of anyone else's.
	for _, id := range blocks {
		if !slices.Contains(h.blocks, id) {
			return fmt.Errorf("request %q: block %d: %w", rid, id, errKVNotHeld)
		}
	}
	if h.transferFail {
		return errInjectedTransfer
	}
	if h.room != nil {
		h.room.transferring = true
	}
	return nil
}

func (e *Engine) handlePull(w http.ResponseWriter, r *http.Request) {
	var req pullRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil || req.RequestID == "" {
		writeError(w, badRequest("invalid_pull", "pull needs a JSON body with request_id and block_ids"))
		return
	}
	if err := e.checkHeld(req.EngineID, req.RequestID, req.BlockIDs); err != nil {
		if errors.Is(err, errInjectedTransfer) {
			// The decoder reports the failure (outcome "failed"): the room is
			// freed then, once, as any transfer's end.
			e.log.Warn("kv pull failed: injected fault", zap.String("request_id", req.RequestID))
			writeError(w, statusError(http.StatusInternalServerError, "kv_transfer_failed", "%v", err))
			return
		}
		e.log.Warn("kv pull of blocks not held refused", zap.String("request_id", req.RequestID), zap.Error(err))
		writeError(w, statusError(http.StatusGone, "kv_not_held", "%v", err))
		return
	}
	writeJSON(w, http.StatusOK, pullResponse{Blocks: len(req.BlockIDs)})
}

func (e *Engine) handleNotify(w http.ResponseWriter, r *http.Request) {
	var req pullRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil || req.RequestID == "" {
		writeError(w, badRequest("invalid_notify", "notify needs a JSON body with request_id"))
		return
	}
	if !e.isEngine(w, req.EngineID) {
		return
	}
	if req.Outcome != "" && req.Outcome != outcomeFailed {
		writeError(w, badRequest("invalid_notify", "outcome %q: want \"\" or %q", req.Outcome, outcomeFailed))
		return
	}
	e.transferEnded(req.RequestID, req.Outcome)
	writeJSON(w, http.StatusOK, struct{}{})
}

func (e *Engine) handleHeartbeat(w http.ResponseWriter, r *http.Request) {
	var req heartbeatRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req); err != nil || len(req.RequestIDs) == 0 || slices.Contains(req.RequestIDs, "") {
		writeError(w, badRequest("invalid_heartbeat", "heartbeat needs a JSON body with a non-empty request_ids list"))
		return
	}
	if !e.isEngine(w, req.EngineID) {
		return
	}
	e.heartbeat(req.RequestIDs)
	writeJSON(w, http.StatusOK, struct{}{})
}

// isEngine answers 404 when a decoder names another engine than this one.
func (e *Engine) isEngine(w http.ResponseWriter, engineID string) bool {
	if engineID != "" && engineID != e.id {
		writeError(w, statusError(http.StatusNotFound, "unknown_engine", "engine %q is not this engine (%q)", engineID, e.id))
		return false
	}
	return true
}
