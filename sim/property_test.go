package sim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
)

// checkPool verifies the pool against the scheduler's view: every block is
// free (holding nothing, or cached and unreferenced), or referenced by
// exactly the live and held requests that list it.
func checkPool(e *Engine) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	refs := 0
	for _, r := range e.pool.refs {
		refs += len(r)
	}
	referenced := 0
	for _, r := range e.pool.refs {
		if len(r) > 0 {
			referenced++
		}
	}
	listed := 0
	for _, group := range []map[string]*request{e.live, e.held} {
		for _, r := range group {
			for _, id := range r.blocks {
				if !slices.Contains(e.pool.refs[id], r.seq) {
					return fmt.Errorf("request %s lists block %d referenced by %v", r.rid, id, e.pool.refs[id])
				}
			}
			listed += len(r.blocks)
		}
	}
	if refs != listed || referenced+e.pool.available() != e.pool.total() {
		return fmt.Errorf("references %d, listed %d, referenced %d, free %d, total %d", refs, listed, referenced, e.pool.available(), e.pool.total())
	}
	for h, id := range e.pool.byHash {
		if !e.pool.cached[id] || e.pool.hashOf[id] != h {
			return fmt.Errorf("cache maps %x to block %d, which caches %x (cached %v)", h, id, e.pool.hashOf[id], e.pool.cached[id])
		}
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
		bases := make([][]uint32, 3)
		for i := range bases {
			bases[i] = make([]uint32, 150)
			for j := range bases[i] {
				bases[i][j] = uint32(rng.IntN(4)) // few tokens: texts share prefixes too
			}
		}
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
				// Prompts are prefixes of a few texts, so that they share
				// cached blocks, evict each other and hit.
				toks := bases[rng.IntN(len(bases))][:1+rng.IntN(150)]
				r, err := e.newRequest(rid(), &apiRequest{promptTokens: len(toks), tokens: [][]uint32{toks}, maxTokens: 1 + rng.IntN(4), ignoreEOS: rng.IntN(2) == 0, kind: kind, kv: kv})
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
