package sim

import (
	"testing"
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
