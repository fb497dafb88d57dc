package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// BenchmarkPrefillDecodeOverHTTP measures one P/D round trip (prefill on P,
// 16-token streamed decode on D with the pull and notify) with no simulated
// latency: the sim's own overhead, which bounds the proxy's benchmarks.
func BenchmarkPrefillDecodeOverHTTP(b *testing.B) {
	cfg := DefaultConfig()
	cfg.PrefillTime, cfg.ITL = 0, 0
	startBench := func() *testServer {
		e, err := New(cfg, zap.NewNop())
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()
		ts := &testServer{e: e, client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
		ts.srv = newLoopbackServer(e.Handler())
		b.Cleanup(func() {
			ts.srv.Close()
			cancel()
			<-done
			ts.client.CloseIdleConnections()
		})
		return ts
	}
	p, d := startBench(), startBench()
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		i++
		rid := fmt.Sprintf("bench-%d", i)
		kv := p.prefillB(b, rid)
		resp, err := d.do(context.Background(), "/v1/completions",
			`{"prompt":"hello world","max_tokens":16,"ignore_eos":true,"stream":true,"kv_transfer_params":`+kv+`}`, map[string]string{"X-Request-Id": rid})
		if err != nil || resp.StatusCode != http.StatusOK {
			b.Fatalf("decode: %v", err)
		}
		drain(resp)
	}
	b.StopTimer()
	testutil.WaitFor(b, 5*time.Second, func() (bool, string) {
		s := p.e.Stats()
		return s.HeldRequests == 0, fmt.Sprintf("P still holds: %+v", s)
	})
}

// BenchmarkStep measures a scheduler step with 256 requests decoding.
func BenchmarkStep(b *testing.B) {
	clock := newFakeClock()
	cfg := DefaultConfig()
	cfg.Clock, cfg.PrefillTime, cfg.ITL = clock, 0, 0
	e, err := New(cfg, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	reqs := make([]*request, 256)
	for i := range reqs {
		reqs[i], _ = e.newRequest(fmt.Sprintf("r%d", i), &apiRequest{promptTokens: 100, maxTokens: 1 << 20, ignoreEOS: true})
		_ = e.submit(reqs[i])
	}
	b.ReportAllocs()
	for b.Loop() {
		e.step(clock.Now())
		for _, r := range reqs {
			r.take() // as the handlers would
		}
	}
}

func (ts *testServer) prefillB(b *testing.B, rid string) string {
	resp, err := ts.do(context.Background(), "/v1/completions", `{"prompt":"hello world","max_tokens":1,"ignore_eos":true,`+prefillKV+`}`, map[string]string{"X-Request-Id": rid})
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	var pr struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&pr); err != nil || string(pr.KV) == "null" {
		b.Fatalf("prefill: %v %s", err, pr.KV)
	}
	return string(pr.KV)
}

func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

func newLoopbackServer(h http.Handler) *httptest.Server { return httptest.NewServer(h) }
