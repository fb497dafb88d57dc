package sim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"go.uber.org/zap"
)

// checkPool verifies the pool against the scheduler's view: every block is
// free, or owned by exactly the live or held request that lists it.
func checkPool(e *Engine) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	owned := 0
	for _, o := range e.pool.owner {
		if o != 0 {
			owned++
		}
	}
	listed := 0
	for _, group := range []map[string]*request{e.live, e.held} {
		for _, r := range group {
			for _, id := range r.blocks {
				if e.pool.owner[id] != r.seq {
					return fmt.Errorf("request %s lists block %d owned by %d", r.rid, id, e.pool.owner[id])
				}
			}
			listed += len(r.blocks)
		}
	}
	if owned != listed || owned+e.pool.available() != e.pool.total() {
		return fmt.Errorf("owned %d, listed %d, free %d, total %d", owned, listed, e.pool.available(), e.pool.total())
	}
	return nil
}

func TestRandomInterleavingsKeepThePoolWholeAndFreeEverythingAtTheEnd(t *testing.T) {
	const iterations, ops = 300, 200
	for seed := range uint64(iterations) {
		rng := rand.New(rand.NewPCG(seed, 0x5eed))
		clock := newFakeClock()
		cfg := scriptedConfig()
		cfg.KVBlocks = 24
		cfg.MaxRunning = 4
		cfg.KVHoldTimeout = 200 * time.Millisecond
		cfg.Clock = clock
		// A no-op logger: late events are expected by the thousand here.
		e, err := New(cfg, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		var reqs []*request
		rid := func() string { return fmt.Sprintf("r%d", rng.IntN(12)) } // collisions on purpose
		pick := func() *request {
			if len(reqs) == 0 {
				return nil
			}
			return reqs[rng.IntN(len(reqs))]
		}
		stepAndCheck := func(op int) {
			e.step(clock.Now())
			s := e.Stats()
			if s.BlocksFree+s.BlocksInUse+s.BlocksHeld != s.BlocksTotal || s.DoubleFreeAttemptsTotal != 0 {
				t.Fatalf("seed %d op %d: %+v", seed, op, s)
			}
			if err := checkPool(e); err != nil {
				t.Fatalf("seed %d op %d: %v", seed, op, err)
			}
		}
		for op := range ops {
			switch rng.IntN(10) {
			case 0, 1:
				kind := reqKind(rng.IntN(3))
				var kv *kvTransferParams
				if kind == kindDecode {
					kv = &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int{1}, RemoteHost: "127.0.0.1", RemotePort: 1}
				}
				r, err := e.newRequest(rid(), &apiRequest{promptTokens: 1 + rng.IntN(150), maxTokens: 1 + rng.IntN(4), ignoreEOS: rng.IntN(2) == 0, kind: kind, kv: kv})
				if err != nil {
					t.Fatal(err)
				}
				_ = e.submit(r)
				reqs = append(reqs, r)
			case 2:
				if r := pick(); r != nil {
					e.abortRequest(r)
				}
			case 3:
				e.abortRID(rid())
			case 4:
				if rng.IntN(2) == 0 {
					e.finishedSending(rid())
				} else {
					e.heartbeat([]string{rid(), rid()})
				}
			case 5:
				if r := pick(); r != nil {
					var err error
					if rng.IntN(3) == 0 {
						err = errKVNotHeld
					}
					e.finishedReceiving(r, err)
				}
			case 6:
				clock.Advance(time.Duration(rng.IntN(60)) * time.Millisecond)
			default:
				stepAndCheck(op)
			}
		}
		// Wind down: end every decode's pull, abort everything, let holds expire.
		for _, r := range reqs {
			e.finishedReceiving(r, errors.New("wind down"))
			e.abortRequest(r)
		}
		stepAndCheck(ops)
		clock.Advance(cfg.KVHoldTimeout)
		stepAndCheck(ops + 1)
		if s := e.Stats(); !allFree(s) || s.DoubleFreeAttemptsTotal != 0 {
			t.Fatalf("seed %d: at the end %+v, want all blocks free and no double free", seed, s)
		}
	}
}
