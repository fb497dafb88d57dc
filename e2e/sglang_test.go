package e2e

// End-to-end tests of pdproxy in front of SGLang engines (issue 12): the simulator's SGLang
// protocol (kvbackend/sim/sglang.go) on loopback, both legs of a request at once, paired by a
// bootstrap room on the prefiller. The sims notice a client that left only after a long
// disconnect delay, so whatever is freed promptly here was freed by the proxy's explicit
// aborts (/abort_request), not by SGLang's own disconnect detection.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/kvbackend/sim"
	"github.com/pdproxy/pdproxy/router"
)

// sglangDisconnectDelay is how late the SGLang sims notice a client that left: far longer
// than any wait in these tests.
const sglangDisconnectDelay = 30 * time.Second

// sglangSims makes the stack's engines SGLang prefillers and decoders, quick, and slow to
// notice a gone client.
func sglangSims(c *app.Config) {
	for i := range c.Sims {
		c.Sims[i].Protocol = sim.ProtocolSGLang
		c.Sims[i].DisconnectDelay = sglangDisconnectDelay
		c.Sims[i].KVHoldTimeout = 0 // rooms have no lease
		c.Sims[i].PrefillTime = 2 * time.Millisecond
		c.Sims[i].ITL = time.Millisecond
	}
}

// sglangIdle reports an SGLang engine with every block free and nothing held, waited for,
// queued or running.
func sglangIdle(st sim.KVStats) bool {
	return st.BlocksFree == st.BlocksTotal && st.HeldRequests == 0 && st.RunningRequests == 0 &&
		st.WaitingRequests == 0 && st.RoomsWaiting == 0 && st.RoomsHeld == 0 && st.DoubleFreeAttemptsTotal == 0
}

// enginesIdle holds once every engine at urls is idle (sglangIdle).
func enginesIdle(t *testing.T, urls ...string) func() (bool, string) {
	return func() (bool, string) {
		for _, u := range urls {
			if st := kv(t, u); !sglangIdle(st) {
				return false, u + ": " + jsonString(st)
			}
		}
		return true, ""
	}
}

// handoffs reads pdproxy_kv_hold_handoffs_total{result}.
func handoffs(t *testing.T, s *stack, result string) float64 {
	return testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": result})
}

// tokensOf counts the tokens of an answer: the usage of a whole one, the chunks with text
// of a stream (a sim's token is never empty with ignore_eos). done: a stream ended [DONE].
func tokensOf(t *testing.T, body []byte, stream bool) (tokens, choices int, done bool) {
	t.Helper()
	if !stream {
		var c completion
		if err := json.Unmarshal(body, &c); err != nil || c.Usage == nil {
			t.Fatalf("answer %q: %v", body, err)
		}
		return c.Usage.CompletionTokens, len(c.Choices), true
	}
	seen := map[int]bool{}
	for _, ev := range sseEvents(t, strings.NewReader(string(body))) {
		if ev == "[DONE]" {
			done = true
			continue
		}
		var c struct {
			Choices []struct {
				Index int     `json:"index"`
				Text  *string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("stream event %q: %v", ev, err)
		}
		for _, ch := range c.Choices {
			seen[ch.Index] = true
			if (ch.Text != nil && *ch.Text != "") || ch.Delta.Content != "" {
				tokens++
			}
		}
	}
	return tokens, len(seen), done
}

var sglangShapes = []struct {
	name, route, body string
	stream            bool
	prompts           int
}{
	{"completion", "/v1/completions", `{"model":"sim","prompt":"` + prompt(40) + `","max_tokens":6,"ignore_eos":true}`, false, 1},
	{"completion stream", "/v1/completions", `{"model":"sim","prompt":"` + prompt(40) + `","max_tokens":6,"ignore_eos":true,"stream":true}`, true, 1},
	{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"` + prompt(40) + `"}],"max_tokens":6,"ignore_eos":true}`, false, 1},
	{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"` + prompt(40) + `"}],"max_tokens":6,"ignore_eos":true,"stream":true}`, true, 1},
	{"batch", "/v1/completions", `{"model":"sim","prompt":["` + prompt(40) + `","second","third"],"max_tokens":6,"ignore_eos":true}`, false, 3},
	{"batch stream", "/v1/completions", `{"model":"sim","prompt":["` + prompt(40) + `","second"],"max_tokens":6,"ignore_eos":true,"stream":true}`, true, 2},
}

func TestSGLangRequestsOfEveryShapeAreAnsweredByTheDecoderAndLeaveNothingHeld(t *testing.T) {
	for _, tc := range sglangShapes {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, sglangSims)
			p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
			resp := post(t, context.Background(), s.url+tc.route, tc.body)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %q: %v", resp.StatusCode, body, err)
			}
			// The prefill leg makes one token a prompt; all six come from the decoder.
			tokens, choices, done := tokensOf(t, body, tc.stream)
			if tokens != 6*tc.prompts || choices != tc.prompts || !done {
				t.Errorf("answer has %d tokens in %d choices (ended: %v), want %d in %d: %s", tokens, choices, done, 6*tc.prompts, tc.prompts, body)
			}
			testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
			if ps, ds := kv(t, p), kv(t, d); ps.HoldsTotal != tc.prompts || ds.RemotePrefillRequestsTotal != 1 || ps.AbortedTotal+ds.AbortedTotal != 0 {
				t.Errorf("prefiller %s, decoder %s: want %d rooms held once, one decode leg, no abort", jsonString(ps), jsonString(ds), tc.prompts)
			}
			if got := handoffs(t, s, "handed_over"); got != 1 {
				t.Errorf("handoffs{handed_over} = %v, want 1", got)
			}
			s.assertQuiet(time.Second)
		})
	}
}

// sglangEngine runs an SGLang sim of its own, outside the app (which adds every sim it runs
// to the pools), so that a test can stand between the proxy and the engine: wrap, when not
// nil, wraps its handler. It is stopped when the test ends, after the proxy.
func sglangEngine(t *testing.T, role string, wrap func(http.Handler) http.Handler) string {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Protocol, cfg.Role = sim.ProtocolSGLang, role
	cfg.BootstrapPort = 0 // a free port, which /server_info reports
	cfg.DisconnectDelay = sglangDisconnectDelay
	cfg.PrefillTime, cfg.ITL = 2*time.Millisecond, time.Millisecond
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	h := eng.Handler()
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
		srv.CloseClientConnections() // a leg held at a doorway ends with its connection
		srv.Close()
	})
	return srv.URL
}

// doorway holds every completion request back at an engine's door until its caller gives up
// on it: a leg still on its way to the engine, which has not seen it.
type doorway struct{ arrived atomic.Int32 }

func (d *doorway) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/completions") {
			h.ServeHTTP(w, r)
			return
		}
		// The body read whole, the server watches the connection: the context ends with it.
		io.Copy(io.Discard, r.Body)
		d.arrived.Add(1)
		<-r.Context().Done()
	})
}

// legsOf waits until request id is on its paired legs in the proxy and cond holds on the
// prefiller and decoder at p and d.
func legsOf(t *testing.T, s *stack, id, p, d string, cond func(p, d sim.KVStats) bool) func() (bool, string) {
	return func() (bool, string) {
		st, ok := s.m.Table.State(id)
		if !ok || st.Terminal() {
			return false, fmt.Sprintf("%s not in flight (%v)", id, st)
		}
		ps, ds := kv(t, p), kv(t, d)
		return cond(ps, ds), fmt.Sprintf("%s %v; prefiller %s; decoder %s", id, st, jsonString(ps), jsonString(ds))
	}
}

// noDamage checks what no race may leave on an engine: a double free or a crash.
func noDamage(t *testing.T, urls ...string) {
	t.Helper()
	for _, u := range urls {
		if st := kv(t, u); st.DoubleFreeAttemptsTotal != 0 || st.EngineCrashesTotal != 0 {
			t.Errorf("%s: %s", u, jsonString(st))
		}
	}
}

// stillServes checks that the stack answers a request whole after a race.
func stillServes(t *testing.T, s *stack) {
	t.Helper()
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"after","max_tokens":5,"ignore_eos":true}`)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if tokens, _, _ := tokensOf(t, body, false); resp.StatusCode != http.StatusOK || tokens != 5 {
		t.Errorf("a request after the race: %d %s", resp.StatusCode, body)
	}
}

// The races of shared/PROTOCOL.md in their SGLang form. The proxy holds a request's room from
// the moment its legs go out until the decoder has the KV (its first byte, or the
// prefiller's answer, which comes once the transfer is done): a client leaving before that
// gets both legs aborted, the decoder's first; after it, the decoder's.

func TestSGLangR1ClientLeavesWhileThePrefillerFinishesItsLastStep(t *testing.T) {
	body := `{"model":"sim","prompt":"` + prompt(200) + `","max_tokens":200,"ignore_eos":true,"stream":true}`

	t.Run("the prefill done, its room held, no decoder has claimed it: the prefiller's abort frees it", func(t *testing.T) {
		// The sim's decoder claims its room as soon as a leg reaches it: a room nobody
		// claimed is one whose decode leg has not reached its engine yet.
		var door doorway
		d := sglangEngine(t, "decode", door.wrap)
		s := startStack(t, sglangSims, func(c *app.Config) {
			c.Sims = c.Sims[:1]
			c.Router.Backends = []router.BackendConfig{{Name: "late-decoder", URL: d, Role: router.RoleDecode, Engine: "sglang"}}
		})
		p := s.m.SimURLs("prefill")[0]
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := inBackground(t, ctx, s.url+"/v1/completions", body, "X-Request-Id", "r1")
		testutil.WaitFor(t, 2*time.Second, legsOf(t, s, "r1", p, d, func(ps, ds sim.KVStats) bool {
			return ps.RoomsHeld == 1 && door.arrived.Load() == 1 && ds.RoomsWaiting == 0
		}))
		cancel()
		<-done
		testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		if ps := kv(t, p); ps.AbortedTotal != 1 {
			t.Errorf("prefiller %s: want its room aborted", jsonString(ps))
		}
		// The decoder never saw the leg: its abort was a no-op, counted.
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			ds := kv(t, d)
			return ds.RequestsTotal == 0 && ds.AbortedTotal == 0 && ds.LateEventsTotal >= 1, "decoder: " + jsonString(ds)
		})
		if got := handoffs(t, s, "released"); got != 1 {
			t.Errorf("handoffs{released} = %v, want 1", got)
		}
		noDamage(t, p, d)
		s.assertQuiet(time.Second)
	})

	t.Run("the client leaves at moments all around the prefill's end: every room is freed", func(t *testing.T) {
		s := startStack(t, sglangSims, func(c *app.Config) { c.Sims[0].PrefillTime = 40 * time.Millisecond })
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		for i := range 12 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i+1)*8*time.Millisecond)
			<-inBackground(t, ctx, s.url+"/v1/completions", body)
			cancel()
			testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		}
		// Whenever it left, the request's room was freed by the proxy's aborts or taken by
		// its decoder: never left to the engine (which, with NIXL, would hold it for good).
		if got := handoffs(t, s, "left_to_engine"); got != 0 {
			t.Errorf("handoffs{left_to_engine} = %v", got)
		}
		t.Logf("rooms released %v, handed over %v; prefiller %s", handoffs(t, s, "released"), handoffs(t, s, "handed_over"), jsonString(kv(t, p)))
		noDamage(t, p, d)
		stillServes(t, s)
		s.assertQuiet(time.Second)
	})
}

func TestSGLangR2ClientLeavesAfterThePrefillBeforeTheDecoderPulls(t *testing.T) {
	// The decoder has claimed the room (the sim's decoder does so as its leg arrives) and
	// queues for a slot behind a long stream. A decode aborted before its pull tells the
	// prefiller nothing: only the proxy's abort of the prefill leg frees the room.
	s := startStack(t, sglangSims, func(c *app.Config) { c.Sims[1].MaxRunning = 1 })
	p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	stop := busyDecoder(t, s)
	defer stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(300)+`","max_tokens":5,"ignore_eos":true}`, "X-Request-Id", "r2")
	testutil.WaitFor(t, 2*time.Second, legsOf(t, s, "r2", p, d, func(ps, ds sim.KVStats) bool {
		return ps.RoomsHeld == 1 && ds.WaitingRequests == 1
	}))
	cancel()
	<-done
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		ps, ds := kv(t, p), kv(t, d)
		return ps.RoomsHeld == 0 && ps.HeldRequests == 0 && ps.BlocksFree == ps.BlocksTotal && ds.WaitingRequests == 0,
			"prefiller " + jsonString(ps) + ", decoder " + jsonString(ds)
	})
	if ps, ds := kv(t, p), kv(t, d); ps.AbortedTotal != 1 || ds.AbortedTotal != 1 {
		t.Errorf("prefiller %s, decoder %s: want each leg aborted once", jsonString(ps), jsonString(ds))
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "prefilling"}); got != 1 {
		t.Errorf("aborts{stage=prefilling} = %v, want 1", got)
	}
	stop()
	testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
	noDamage(t, p, d)
	s.assertQuiet(time.Second)
}

func TestSGLangR3ClientLeavesWhileTheDecoderPullsOrDecodes(t *testing.T) {
	t.Run("pulling: the decoder is aborted at once, and the room freed", func(t *testing.T) {
		// 1000 prompt tokens are 63 blocks; at 10ms a block the pull takes 630ms.
		s := startStack(t, sglangSims, func(c *app.Config) { c.Sims[1].KVTransferTime = 10 * time.Millisecond })
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(1000)+`","max_tokens":50,"ignore_eos":true,"stream":true}`, "X-Request-Id", "r3")
		testutil.WaitFor(t, 2*time.Second, legsOf(t, s, "r3", p, d, func(ps, ds sim.KVStats) bool {
			return ds.RunningRequests == 1 && ds.BlocksInUse > 0 && ps.HeldRequests == 1
		}))
		cancel()
		<-done
		// Not the decoder's own disconnect detection, 30s later: the proxy's abort.
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			ds := kv(t, d)
			return ds.AbortedTotal == 1, "decoder: " + jsonString(ds)
		})
		testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		noDamage(t, p, d)
		stillServes(t, s)
		s.assertQuiet(time.Second)
	})

	t.Run("decoding: the decoder is aborted at once", func(t *testing.T) {
		s := startStack(t, sglangSims, func(c *app.Config) { c.Sims[1].ITL = 5 * time.Millisecond })
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		resp := post(t, ctx, s.url+"/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"`+prompt(100)+`"}],"max_tokens":100000,"ignore_eos":true,"stream":true}`)
		readDataLines(t, bufio.NewReader(resp.Body), 5)
		cancel()
		resp.Body.Close()
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			ds := kv(t, d)
			return ds.AbortedTotal == 1 && sglangIdle(ds), "decoder: " + jsonString(ds)
		})
		testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"}); got != 1 {
			t.Errorf("aborts{stage=decoding} = %v, want 1", got)
		}
		if got := handoffs(t, s, "handed_over"); got != 1 {
			t.Errorf("handoffs{handed_over} = %v, want 1", got)
		}
		noDamage(t, p, d)
		stillServes(t, s)
		s.assertQuiet(time.Second)
	})
}

// R4, a hold's deadline passing before its params reach the decoder, has no SGLang form in
// the proxy: no kv_transfer_params cross it (the legs go out together and meet in the
// prefiller's room), so it keeps no hold deadline (SGLang's KVHoldTimeout is 0). Its nearest
// kin, a room that no decoder will ever claim because the decode leg failed, is
// TestSGLangLostDecodeLegGetsThePrefillersRoomAborted.

func TestSGLangR5AbortOfAFinishedRequestIsANoOp(t *testing.T) {
	// The decoder writes slowly: the client leaves on the last token, and the proxy's abort
	// reaches a request the engine finished while it still writes [DONE].
	s := startStack(t, sglangSims)
	p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	const n = 4
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp := post(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"p","max_tokens":2,"ignore_eos":true,"stream":true}`,
				"X-Request-Id", fmt.Sprintf("r5-%d", i), sim.HeaderSlowWrite, "150ms")
			br := bufio.NewReader(resp.Body)
			for {
				line, err := br.ReadString('\n')
				if err != nil || strings.Contains(line, `"finish_reason":"length"`) {
					break
				}
			}
			cancel()
			resp.Body.Close()
		})
	}
	wg.Wait()
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		ds := kv(t, d)
		return ds.LateEventsTotal >= n && ds.AbortedTotal == 0, "decoder: " + jsonString(ds)
	})
	if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"}); got != n {
		t.Errorf("aborts{stage=decoding} = %v, want %d", got, n)
	}
	testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
	noDamage(t, p, d)
	stillServes(t, s)
	s.assertQuiet(time.Second)
}
