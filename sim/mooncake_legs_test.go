package sim

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/engine"
)

// The legs the proxy's engine.Mooncake builds, from the engine ids its Bootstrap reads
// off GET /query, are served by a data parallel prefiller's rank they name; its drain leg
// alone frees a hold whose legs were aborted after the prefill.
func TestMooncakeServesTheLegsTheProxyBuilds(t *testing.T) {
	pcfg := mooncakeConfig("prefill")
	pcfg.DataParallelSize = 2
	pr := startMooncake(t, pcfg, mooncakeConfig("decode"))
	port := pr.p.e.boot.port()
	boot, err := engine.Mooncake.Bootstrap(context.Background(), pr.p.client, pr.p.srv.URL, port)
	if err != nil || len(boot.EngineIDs) != 2 {
		t.Fatalf("Bootstrap = %+v, %v; want two ranks", boot, err)
	}
	prompt := strings.Repeat("red green blue ", 15)
	for i, tc := range []struct {
		name, path, body string
		rank             int
		drainOnly        bool
	}{
		{"completions on rank 0", "/v1/completions", `{"prompt":"` + prompt + `","max_tokens":4,"ignore_eos":true}`, 0, false},
		{"chat streamed on rank 1", "/v1/chat/completions", `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":4,"ignore_eos":true,"stream":true}`, 1, false},
		{"the drain leg after aborted legs, rank 1", "/v1/completions", `{"prompt":"` + prompt + `","max_tokens":4}`, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := engine.ParseFields([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			xfer := fmt.Sprintf("xfer-legs-%d", i)
			calls, err := engine.Mooncake.Legs(f, engine.Leg{TransferID: xfer, EngineID: boot.EngineIDs[tc.rank], Host: "127.0.0.1", Port: port, Rank: tc.rank})
			if err != nil {
				t.Fatalf("Legs: %v", err)
			}
			hdr := map[string]string{"X-Request-Id": xfer}
			for k := range calls.PrefillHeader {
				hdr[k] = calls.PrefillHeader.Get(k)
			}
			before := pr.p.kv(t).Ranks[tc.rank].HoldsTotal
			pa := pr.p.send(context.Background(), tc.path, string(calls.Prefill), hdr)
			decode := calls.Decode
			if tc.drainOnly {
				// The client left once the prefill was done: the proxy sends only the drain.
				if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
					t.Fatalf("prefill leg answered %d %s", a.status, a.body)
				}
				heldStill(t, pr.p, tc.rank, "after the prefill of aborted legs")
				decode = calls.Drain
			}
			da := recvAnswer(t, pr.d.send(context.Background(), tc.path, string(decode), map[string]string{"X-Request-Id": xfer}), "decode leg")
			if da.status != http.StatusOK {
				t.Fatalf("decode leg answered %d %s", da.status, da.body)
			}
			if !tc.drainOnly {
				if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
					t.Fatalf("prefill leg answered %d %s", a.status, a.body)
				}
				if got, want := decodedText(t, da, strings.Contains(tc.body, `"stream":true`)), expectedText(0, xfer, 4); got != want {
					t.Errorf("decode text = %q, want %q", got, want)
				}
			}
			s := pr.p.waitKV(t, "the prefiller frees its hold after the pull", allFree)
			if s.Ranks[tc.rank].HoldsTotal != before+1 || s.ExpiredTotal != 0 {
				t.Errorf("prefiller /debug/kv = %+v, want rank %d's hold freed by the pull", s, tc.rank)
			}
			if ds := pr.d.waitKV(t, "decoder done", allFree); ds.KVLoadFailuresTotal != 0 {
				t.Errorf("decoder /debug/kv = %+v, want no load failure", ds)
			}
		})
	}
}
