package e2e

// Regression tests for the races R1 to R5 (docs/engines.md#the-races), with simulated engines on
// loopback. Each fails on a proxy without the guard it names.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
)

// prompt makes a prompt of about n tokens for the simulator (4 bytes a token).
func prompt(n int) string { return strings.Repeat("abc ", n) }

// inBackground sends a request whose client gives up when ctx ends; done closes when it does.
func inBackground(t *testing.T, ctx context.Context, url, body string, hdr ...string) (done chan int) {
	done = make(chan int, 1)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

func prefillerHoldsNothing(t *testing.T, s *stack) func() (bool, string) {
	return func() (bool, string) {
		st := kv(t, s.m.SimURLs("prefill")[0])
		return st.HeldRequests == 0 && st.BlocksFree == st.BlocksTotal, "prefiller: " + jsonString(st)
	}
}

func TestR1ClientLeavesWhileThePrefillerFinishesItsLastStep(t *testing.T) {
	// X-Sim-Stall holds the prefiller's answer back after its step finished and its blocks
	// are held: the client leaving then is the abort that reaches an engine that already
	// finished, which the engine ignores.
	const stall = "600ms"
	body := `{"model":"sim","prompt":"` + prompt(200) + `","max_tokens":5,"ignore_eos":true}`

	t.Run("an engine with an explicit abort is told, and frees the hold at once", func(t *testing.T) {
		s := startStack(t, fastSims)
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		defer cancel()
		<-inBackground(t, ctx, s.url+"/v1/completions", body, "X-Sim-Stall", stall)
		left := time.Now()
		testutil.WaitFor(t, time.Second, prefillerHoldsNothing(t, s))
		t.Logf("prefiller free %s after the client left", time.Since(left).Round(time.Millisecond))
		if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "prefilling"}); got != 1 {
			t.Errorf("aborts{stage=prefilling} = %v", got)
		}
		s.assertQuiet(2 * time.Second)
	})

	t.Run("vLLM with finish_then_release: the prefill finishes, then its KV is drained", func(t *testing.T) {
		s := startStack(t, fastSims, func(c *app.Config) {
			c.Sims[0].Engine = "vllm"
			c.Proxy.AbortDuringPrefill = proxy.AbortPrefillFinishThenFree
		})
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		defer cancel()
		<-inBackground(t, ctx, s.url+"/v1/completions", body, "X-Sim-Stall", stall)
		left := time.Now()
		// The prefiller answers when its stall ends; the drain follows at once.
		testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
			return testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "drained"}) == 1, "no drained release"
		})
		testutil.WaitFor(t, time.Second, prefillerHoldsNothing(t, s))
		t.Logf("prefiller free %s after the client left (stall %s)", time.Since(left).Round(time.Millisecond), stall)
		s.assertQuiet(2 * time.Second)
	})

	t.Run("vLLM with cancel: the hold is left to the engine's timer", func(t *testing.T) {
		// What finish_then_release exists for: with no explicit abort, a cancel that loses
		// the race leaves the blocks pinned until the engine's own timeout.
		s := startStack(t, fastSims, func(c *app.Config) {
			c.Sims[0].Engine = "vllm"
			c.Sims[0].KVHoldTimeout = 800 * time.Millisecond
			c.KVHoldTimeout = 500 * time.Millisecond
		})
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		defer cancel()
		<-inBackground(t, ctx, s.url+"/v1/completions", body, "X-Sim-Stall", stall)
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			st := kv(t, s.m.SimURLs("prefill")[0])
			return st.HeldRequests == 1, "prefiller: " + jsonString(st)
		})
		testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
			st := kv(t, s.m.SimURLs("prefill")[0])
			return st.ExpiredTotal == 1 && st.HeldRequests == 0, "prefiller: " + jsonString(st)
		})
		s.assertQuiet(2 * time.Second)
	})
}

// queuedOnDecoder holds once request id is prefilled (its KV held on the prefiller), its
// decode was sent, and the decoder queued it behind a busy slot without pulling yet.
func queuedOnDecoder(t *testing.T, s *stack, id string) func() (bool, string) {
	return func() (bool, string) {
		st, ok := s.m.Table.State(id)
		if !ok || st.String() != "decoding" {
			return false, fmt.Sprintf("%s not decoding yet (%v)", id, st)
		}
		p, d := kv(t, s.m.SimURLs("prefill")[0]), kv(t, s.m.SimURLs("decode")[0])
		return p.HeldRequests == 1 && d.WaitingRequests == 1, "prefiller " + jsonString(p) + ", decoder " + jsonString(d)
	}
}

// busyDecoder starts a long stream that keeps the decoder's only running slot busy; stop ends it.
func busyDecoder(t *testing.T, s *stack) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"busy","max_tokens":100000,"ignore_eos":true,"stream":true}`)
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		st := kv(t, s.m.SimURLs("decode")[0])
		return st.RunningRequests == 1, "decoder not busy yet: " + jsonString(st)
	})
	var once sync.Once
	return func() { once.Do(func() { cancel(); <-done }) }
}

func TestR2ClientLeavesAfterThePrefillBeforeTheDecoderPulls(t *testing.T) {
	body := `{"model":"sim","prompt":"` + prompt(300) + `","max_tokens":5,"ignore_eos":true}`

	t.Run("decode queued in a busy engine: cancelling it makes the decoder notify the prefiller", func(t *testing.T) {
		s := startStack(t, fastSims, func(c *app.Config) { c.Sims[1].MaxRunning = 1 })
		stop := busyDecoder(t, s)
		defer stop()
		ctx, cancel := context.WithCancel(context.Background())
		done := inBackground(t, ctx, s.url+"/v1/completions", body, "X-Request-Id", "r2-queued")
		testutil.WaitFor(t, 2*time.Second, queuedOnDecoder(t, s, "r2-queued"))
		cancel()
		<-done
		left := time.Now()
		testutil.WaitFor(t, time.Second, prefillerHoldsNothing(t, s))
		t.Logf("prefiller free %s after the client left (engine default hold: 480s)", time.Since(left).Round(time.Millisecond))
		stop()
		s.assertQuiet(2 * time.Second)
	})

	for _, tc := range []struct {
		name, release, engine, reason string
	}{
		{"waiting in the proxy for a decoder, kv_release abort: the engine's abort frees it", proxy.ReleaseAbort, "sim", "aborted"},
		{"waiting in the proxy for a decoder, kv_release drain on vLLM: a drain frees it", proxy.ReleaseDrain, "vllm", "drained"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, fastSims, func(c *app.Config) {
				c.Sims[0].Engine = tc.engine
				c.Sims[1].MaxRunning = 1
				c.Sims[1].MaxInflight = 1
				c.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
				c.Proxy.KVRelease = tc.release
				c.Proxy.DrainTimeout = 300 * time.Millisecond
			})
			stop := busyDecoder(t, s)
			defer stop()
			ctx, cancel := context.WithCancel(context.Background())
			done := inBackground(t, ctx, s.url+"/v1/completions", body)
			testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
				for _, r := range s.m.Table.Snapshot() {
					if r.State.String() == "kv_held" {
						return true, ""
					}
				}
				return false, fmt.Sprintf("no request in kv_held: %+v", s.m.Table.Snapshot())
			})
			cancel()
			<-done
			left := time.Now()
			testutil.WaitFor(t, time.Second, prefillerHoldsNothing(t, s))
			t.Logf("prefiller free %s after the client left", time.Since(left).Round(time.Millisecond))
			// The release is recorded when its call returns, a moment after the blocks are free.
			testutil.WaitFor(t, time.Second, func() (bool, string) {
				got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": tc.reason})
				return got == 1, fmt.Sprintf("kv releases{reason=%s} = %v, want 1", tc.reason, got)
			})
			if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "kv_held"}); got != 1 {
				t.Errorf("aborts{stage=kv_held} = %v, want 1", got)
			}
			stop()
			s.assertQuiet(2 * time.Second)
		})
	}
}

func TestR3ClientLeavesWhileTheDecoderPullsKV(t *testing.T) {
	// 1000 prompt tokens are 63 blocks; at 15ms a block the pull takes about a second.
	body := `{"model":"sim","prompt":"` + prompt(1000) + `","max_tokens":50,"ignore_eos":true,"stream":true}`
	pulling := func(t *testing.T, s *stack) func() (bool, string) {
		return func() (bool, string) {
			st := kv(t, s.m.SimURLs("decode")[0])
			return st.RunningRequests == 1 && st.BlocksInUse > 0, "decoder not pulling: " + jsonString(st)
		}
	}
	for _, tc := range []struct {
		name, mode string
		deferred   bool
	}{
		{"immediate: the decode is cancelled mid-pull and the prefiller still frees", proxy.PullAbortImmediate, false},
		{"after_first_token: the cancel waits for the pull to end", proxy.PullAbortAfterFirstToken, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, fastSims, func(c *app.Config) {
				c.Sims[1].KVTransferTime = 15 * time.Millisecond
				c.Proxy.AbortDuringKVPull = tc.mode
			})
			ctx, cancel := context.WithCancel(context.Background())
			done := inBackground(t, ctx, s.url+"/v1/completions", body)
			testutil.WaitFor(t, 2*time.Second, pulling(t, s))
			cancel()
			<-done
			left := time.Now()
			testutil.WaitFor(t, 3*time.Second, func() (bool, string) {
				d := kv(t, s.m.SimURLs("decode")[0])
				return d.AbortedTotal == 1, "decoder: " + jsonString(d)
			})
			testutil.WaitFor(t, time.Second, prefillerHoldsNothing(t, s))
			t.Logf("decoder aborted and prefiller free %s after the client left", time.Since(left).Round(time.Millisecond))
			// The decoder sends its first token only once the pull is over, so the chunks it
			// produced after the client left tell whether the cancel waited for the pull.
			after := testutil.Value(t, s.m.Registry, "pdproxy_tokens_after_disconnect_total", nil)
			if tc.deferred && after < 1 {
				t.Errorf("tokens after disconnect = %v: the cancel did not wait for the first token", after)
			}
			if !tc.deferred && after != 0 {
				t.Errorf("tokens after disconnect = %v: the decode outlived its pull, which was not cut short", after)
			}
			for _, u := range s.allSimURLs() {
				if st := kv(t, u); st.DoubleFreeAttemptsTotal != 0 {
					t.Errorf("%s: double frees %+v", u, st)
				}
			}
			s.assertQuiet(2 * time.Second)
		})
	}
}

func TestR4HoldDeadlinePassesBeforeTheDecodeIsSent(t *testing.T) {
	// The prefiller holds KV for 450ms; the proxy's deadline is 2/3 of it. The only decoder
	// slot is busy for longer, so the prefilled request waits past the deadline.
	s := startStack(t, fastSims, func(c *app.Config) {
		c.Sims[0].KVHoldTimeout = 450 * time.Millisecond
		c.KVHoldTimeout = 300 * time.Millisecond
		c.Sims[1].MaxInflight = 1
		c.Sims[1].ITL = 10 * time.Millisecond
		c.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
	})
	first := inBackground(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"first","max_tokens":60,"ignore_eos":true}`)
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		st := kv(t, s.m.SimURLs("decode")[0])
		return st.RunningRequests == 1, "decoder idle"
	})
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(100)+`","max_tokens":8,"ignore_eos":true}`)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("late request: %d %s (stale kv_transfer_params reached the decoder?)", resp.StatusCode, b)
	}
	var c completion
	if err := json.Unmarshal(b, &c); err != nil || c.Usage == nil || c.Usage.CompletionTokens != 8 {
		t.Fatalf("late request answered %s", b)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_deadline_exceeded_total", nil); got != 1 {
		t.Errorf("deadline exceeded = %v, want 1", got)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); got != 1 {
		t.Errorf("releases{reason=expired} = %v, want 1", got)
	}
	if code := <-first; code != 200 {
		t.Errorf("first request: %d", code)
	}
	s.assertQuiet(2 * time.Second)
}

func TestR5AbortsOfFinishedRequestsAreNoOps(t *testing.T) {
	s := startStack(t, fastSims)
	var wg sync.WaitGroup
	for i := 0; i < 40; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp := post(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"p","max_tokens":4,"ignore_eos":true,"stream":true}`, "X-Request-Id", fmt.Sprintf("r5-%d", i))
			br := bufio.NewReader(resp.Body)
			// Leave right at the end: after the last token (before [DONE]) or after [DONE].
			want := "[DONE]"
			if i%2 == 0 {
				want = `"finish_reason":"length"`
			}
			for {
				line, err := br.ReadString('\n')
				if err != nil || strings.Contains(line, want) {
					break
				}
			}
			cancel()
			resp.Body.Close()
			// The engine is also told to abort the finished request: a no-op for it.
			for _, u := range s.allSimURLs() {
				r, err := http.Post(u+"/abort_request", "application/json", strings.NewReader(fmt.Sprintf(`{"rid":"r5-%d"}`, i)))
				if err == nil {
					r.Body.Close()
				}
			}
		}(i)
	}
	wg.Wait()
	for _, u := range s.allSimURLs() {
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			st := kv(t, u)
			return st.DoubleFreeAttemptsTotal == 0 && st.LateEventsTotal >= 1, u + ": " + jsonString(st)
		})
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "502"}); got != 0 {
		t.Errorf("%v requests failed with 502", got)
	}
	s.assertQuiet(2 * time.Second)
}

func TestProxyKeepsItsHoldDeadlineAMarginBelowTheEnginesLease(t *testing.T) {
	// The lease starts before the proxy reads the prefill's answer, and heartbeats extend it
	// only once a decoder has the request: the proxy forwards params for at most 2/3 of it.
	for _, tc := range []struct {
		name      string
		proxyHold time.Duration // 0: unset
		starts    bool
		want      time.Duration // the deadline in force
	}{
		{name: "longer than the lease is refused", proxyHold: 90 * time.Second},
		{name: "the lease itself is refused", proxyHold: 60 * time.Second},
		{name: "more than 2/3 of the lease is refused", proxyHold: 45 * time.Second},
		{name: "2/3 of the lease starts", proxyHold: 40 * time.Second, starts: true, want: 40 * time.Second},
		{name: "unset is 2/3 of the shortest lease", starts: true, want: 40 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := app.DefaultConfig()
			cfg.Listen = "127.0.0.1:0"
			cfg.Sims[0].KVHoldTimeout = 60 * time.Second
			cfg.KVHoldTimeout = tc.proxyHold
			m, err := app.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
			if err != nil {
				t.Fatal(err)
			}
			err = m.Start(context.Background())
			if err == nil {
				defer m.Shutdown(context.Background())
			}
			if !tc.starts {
				if err == nil {
					t.Fatalf("started with kv_hold_timeout %s in front of a prefiller whose lease is 60s", tc.proxyHold)
				}
				if !strings.Contains(err.Error(), "kv_hold_timeout") {
					t.Fatalf("error does not name kv_hold_timeout: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused to start: %v", err)
			}
			if got := m.Table.KVHoldTimeout(); got != tc.want {
				t.Errorf("hold deadline %s, want %s", got, tc.want)
			}
		})
	}
}
