package sim

import (
	"context"
	"errors"
	"net/http"
	"testing"
)

func TestRunReturnsNilAfterAbortingEverythingWhenCancelled(t *testing.T) {
	cfg := scriptedConfig()
	cfg.KVBlocks, cfg.MaxRunning = 4, 8
	e := newScripted(t, cfg, newFakeClock())
	held, _ := e.holdPrefill(t, "held") // 2 blocks
	running := e.request(t, "running", kindAggregated, 32, 100, nil)
	waiting := e.request(t, "waiting", kindAggregated, 64, 100, nil) // needs the whole pool
	_ = e.submit(running)
	_ = e.submit(waiting)
	e.stepNow()
	pending := e.request(t, "pending", kindAggregated, 1, 1, nil)
	_ = e.submit(pending) // never stepped before the shutdown
	// Waiting: the one queued for blocks and the one no step has seen yet.
	if s := e.Stats(); s.HeldRequests != 1 || s.RunningRequests != 1 || s.WaitingRequests != 2 {
		t.Fatalf("before shutdown %+v", s)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.Run(ctx); err != nil {
		t.Fatalf("Run after cancel = %v, want nil", err)
	}
	checkStats(t, "after Run", e.Stats(), KVStats{BlocksFree: 4, AbortedTotal: 3})
	for _, r := range []*request{running, waiting, pending} {
		outs := r.take()
		var ae *apiError
		if len(outs) == 0 || !errors.As(outs[len(outs)-1].err, &ae) || ae.Status != http.StatusServiceUnavailable {
			t.Errorf("%s: outputs %+v, want a final 503", r.rid, outs)
		}
	}
	if held.state != stateDone {
		t.Errorf("held request state %d, want done", held.state)
	}
	if err := e.submit(e.request(t, "late", kindAggregated, 1, 1, nil)); err == nil {
		t.Error("a stopped engine accepted a request")
	}
	if err := e.Run(context.Background()); err == nil {
		t.Error("Run ran twice")
	}
}
