package sim

import (
	"context"
	"slices"
	"time"

	"go.uber.org/zap"
)

// KV lease heartbeats, vLLM PR #41383 (vLLM's docs/design/kv_cache_lease.md): a
// prefiller holds a finished prefill's blocks under a short lease
// (KVHoldTimeout), and a decoder renews the lease of every do_remote_prefill
// request it has, queued or pulling, so that a decoder that is merely busy
// keeps its blocks while one that died lets them go a lease later.
//
// One heartbeat per prefiller and round carries every request id of that
// prefiller, as vLLM batches them by remote engine:
//
//	POST /kv/heartbeat {"engine_id":"..","request_ids":[".."]}
//	  200 {}   queued; each held request's lease becomes max(lease end, now+lease)
//	           at the prefiller's next step, an unknown id is a late event
//
// The sim renews to now+lease where vLLM renews to now+2/3 of the lease: the
// difference is a constant, and "a heartbeat restores the full lease" is
// easier to reason about in a proxy's tests.

// kvPeer names a prefiller as a decoder reaches it.
type kvPeer struct {
	host     string
	port     int
	engineID string
}

func peerOf(p *kvTransferParams) kvPeer {
	return kvPeer{host: p.RemoteHost, port: p.RemotePort, engineID: p.RemoteEngineID}
}

// heartbeatLoop sends a round of heartbeats when t fires and every
// KVHeartbeatInterval after, until ctx is done. Run owns it and waits for it.
func (e *Engine) heartbeatLoop(ctx context.Context, t Timer) {
	for {
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
		// Arm the next tick before this round's calls: a slow prefiller does
		// not push later rounds back, and a test's fake clock finds the timer
		// set once the round's first heartbeat has reached a prefiller.
		t = e.clock.NewTimer(e.cfg.KVHeartbeatInterval)
		e.sendHeartbeats(ctx)
	}
}

// heartbeatTargets groups the remote request ids of the decodes that need
// their prefiller's lease renewed: queued or pulling, blocks to read, pull
// not yet done. vLLM starts tracking a request when it enters the scheduler
// (on_new_request), not when it is scheduled, because the wait in the queue
// is what outlives a short lease.
func (e *Engine) heartbeatTargets() map[kvPeer][]string {
	now := e.clock.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	var out map[kvPeer][]string
	for _, r := range e.live {
		if !r.readsKV() || r.pulled.Load() || r.leg != nil || r.mc != nil {
			continue // SGLang and Mooncake have no lease to renew
		}
		if r.state != stateWaiting && r.state != statePulling {
			continue
		}
		peer := peerOf(r.remote)
		if now.Before(e.handshake(peer, now)) {
			// vLLM's heartbeats ride NIXL notifications, which need the
			// handshake: the first heartbeat to a new prefiller starts it
			// and the renewal waits for a round after it is done.
			continue
		}
		if out == nil {
			out = make(map[kvPeer][]string)
		}
		out[peer] = append(out[peer], r.remote.RemoteRequestID)
	}
	return out
}

// sendHeartbeats sends one round: one call per prefiller. A failed call is
// logged and otherwise ignored: the next round tries again, and a prefiller
// that stays unreachable cannot be read from either.
func (e *Engine) sendHeartbeats(ctx context.Context) {
	for peer, ids := range e.heartbeatTargets() {
		slices.Sort(ids)
		hctx, cancel := context.WithTimeout(ctx, min(e.cfg.KVHeartbeatInterval, notifyTimeout))
		err := e.transport.heartbeat(hctx, &kvTransferParams{RemoteHost: peer.host, RemotePort: peer.port, RemoteEngineID: peer.engineID}, ids)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				e.log.Warn("kv heartbeat failed", zap.String("prefiller", peer.engineID), zap.Strings("request_ids", ids), zap.Error(err))
			}
			continue
		}
		e.mu.Lock()
		e.counts.heartbeatsSent += len(ids)
		e.mu.Unlock()
	}
}

// handshake returns when the NIXL handshake with peer is done, starting it
// at now if nobody asked for it before. The caller holds e.mu.
func (e *Engine) handshake(peer kvPeer, now time.Time) time.Time {
	if e.cfg.NIXLHandshakeDelay <= 0 {
		return time.Time{}
	}
	done, ok := e.handshakes[peer]
	if !ok {
		done = now.Add(e.cfg.NIXLHandshakeDelay)
		e.handshakes[peer] = done
		e.log.Info("nixl handshake with a prefiller started", zap.String("prefiller", peer.engineID),
			zap.String("host", peer.host), zap.Int("port", peer.port), zap.Duration("takes", e.cfg.NIXLHandshakeDelay))
	}
	return done
}

// heartbeat is the prefiller side of a decoder's heartbeat.
func (e *Engine) heartbeat(rids []string) {
	_ = e.enqueue(event{kind: evHeartbeat, rids: rids})
}

// renewLeases applies a heartbeat at a step: a lease is never shortened
// (vLLM takes the max too), and a request no longer held is a late event,
// logged and ignored, never a crash.
func (e *Engine) renewLeases(rids []string, now time.Time) {
	until := now.Add(e.cfg.KVHoldTimeout)
	for _, rid := range rids {
		h, ok := e.held[rid]
		if ok && h.room != nil {
			continue // an SGLang room has no lease
		}
		if !ok {
			e.late("kv heartbeat for a request no longer held ignored", rid, stateDone)
			continue
		}
		e.counts.heartbeats++
		if until.After(h.expiresAt) {
			h.expiresAt = until
		}
	}
}
