package sim

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestSchedulerAdmitsInFIFOOrderWithinPoolAndRunningLimits(t *testing.T) {
	tests := []struct {
		name       string
		blocks     int
		maxRunning int
		prompts    []int // prompt tokens of r0, r1, r2 (16 per block)
		// after the first step, which requests run; after r0 finishes, which run
		first, second []string
	}{
		{
			name: "head that does not fit blocks the queue, no overtaking", blocks: 4, maxRunning: 8,
			prompts: []int{48, 32, 16}, first: []string{"r0"}, second: []string{"r1", "r2"},
		},
		{
			name: "max running caps admissions", blocks: 16, maxRunning: 1,
			prompts: []int{16, 16, 16}, first: []string{"r0"}, second: []string{"r1"},
		},
		{
			name: "everything fits, everything runs", blocks: 16, maxRunning: 8,
			prompts: []int{16, 16, 16}, first: []string{"r0", "r1", "r2"}, second: []string{"r1", "r2"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := scriptedConfig()
			cfg.KVBlocks, cfg.MaxRunning = tt.blocks, tt.maxRunning
			e := newScripted(t, cfg, newFakeClock())
			reqs := map[string]*request{}
			for i, n := range tt.prompts {
				rid := "r" + string(rune('0'+i))
				// r0 finishes after its single token; the others decode on.
				maxTok := 100
				if i == 0 {
					maxTok = 1
				}
				reqs[rid] = e.request(t, rid, kindAggregated, n, maxTok, nil)
				_ = e.submit(reqs[rid])
			}
			running := func() []string {
				var out []string
				for _, rid := range []string{"r0", "r1", "r2"} {
					if s := reqs[rid].state; s == statePrefilling || s == stateDecoding {
						out = append(out, rid)
					}
				}
				return out
			}
			e.stepNow()
			if got := running(); !equal(got, tt.first) {
				t.Errorf("after admission running %v, want %v", got, tt.first)
			}
			e.clock.Advance(e.cfg.PrefillTime)
			e.stepNow() // r0 emits its only token and frees
			e.stepNow() // the queue moves
			if got := running(); !equal(got, tt.second) {
				t.Errorf("after r0 finished running %v, want %v", got, tt.second)
			}
			if s := e.Stats(); s.BlocksFree+s.BlocksInUse != s.BlocksTotal || s.RunningRequests+s.WaitingRequests != 2 {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestDuplicateRequestIDs(t *testing.T) {
	tests := []struct {
		name     string
		first    reqKind
		second   reqKind
		rejected bool
	}{
		{"a second live request with the same id is rejected", kindAggregated, kindAggregated, true},
		{"a second prefill while the first is held is rejected", kindPrefill, kindPrefill, true},
		{"a decode may share the id of a prefill held on the same engine", kindPrefill, kindDecode, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newScripted(t, scriptedConfig(), newFakeClock())
			kv := &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int{0}, RemoteHost: "127.0.0.1", RemotePort: 1}
			if tt.first == kindPrefill {
				e.holdPrefill(t, "dup")
			} else {
				_ = e.submit(e.request(t, "dup", tt.first, 16, 4, nil))
				e.stepNow()
			}
			second := e.request(t, "dup", tt.second, 16, 4, kv)
			_ = e.submit(second)
			e.stepNow()
			outs := second.take()
			var ae *apiError
			gotRejected := len(outs) == 1 && errors.As(outs[0].err, &ae) && ae.Code == "duplicate_request_id"
			if gotRejected != tt.rejected {
				t.Errorf("second request outputs %+v, rejected=%v, want rejected=%v", outs, gotRejected, tt.rejected)
			}
			if s := e.Stats(); s.BlocksFree+s.BlocksInUse+s.BlocksHeld != s.BlocksTotal || s.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

func TestAWaitingRequestIsAdmittedWhenTheLastRunningOneEndsWithNothingElseArriving(t *testing.T) {
	tests := []struct {
		name       string
		blocks     int
		maxRunning int
	}{
		{"it waited for blocks", 8, 8},
		{"it waited for a running slot", 64, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A fake clock: the first request's second (last) token comes only when the
			// test moves the clock, after the second request is queued behind it.
			clock := newFakeClock()
			cfg := fastConfig()
			cfg.Clock, cfg.PrefillTime, cfg.ITL = clock, 0, time.Hour
			cfg.KVBlocks, cfg.MaxRunning = tt.blocks, tt.maxRunning
			cfg.DisablePrefixCache = true // two prompts of 5 blocks that share none
			ts := startServer(t, cfg)
			body := `{"prompt":"` + strings.Repeat("abcd", 70) + `","max_tokens":2,"ignore_eos":true}` // 70 tokens: 5 blocks
			first := ts.send(context.Background(), "/v1/completions", body, nil)
			ts.waitKV(t, "the first runs", func(s KVStats) bool { return s.RunningRequests == 1 })
			second := ts.send(context.Background(), "/v1/completions", body, nil)
			ts.waitKV(t, "the second waits", func(s KVStats) bool { return s.WaitingRequests == 1 })
			clock.Advance(time.Hour) // the first ends; nothing else arrives
			ts.waitKV(t, "the second is admitted", func(s KVStats) bool { return s.RunningRequests == 1 && s.WaitingRequests == 0 })
			clock.Advance(time.Hour)
			for i, ch := range []<-chan answer{first, second} {
				if a := recvAnswer(t, ch, "an answer"); a.status != http.StatusOK {
					t.Errorf("request %d: status %d: %s", i, a.status, a.body)
				}
			}
		})
	}
}
