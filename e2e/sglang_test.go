package e2e

// End-to-end tests of pdproxy in front of SGLang engines: the simulator's SGLang
// protocol (engine/sim/sglang.go) on loopback, both legs of a request at once, paired by a
// bootstrap room on the prefiller. The sims notice a client that left only after a long
// disconnect delay, so whatever is freed promptly here was freed by the proxy's explicit
// aborts (/abort_request), not by SGLang's own disconnect detection.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
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
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
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

// The races R1-R5 (docs/engines.md#the-races) in their SGLang form. The proxy holds a request's room from
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
			c.Router.Backends = []routerconfig.BackendConfig{{Name: "late-decoder", URL: d, Role: routerconfig.RoleDecode, Engine: "sglang"}}
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
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			got := handoffs(t, s, "released")
			return got == 1, fmt.Sprintf("handoffs{released} = %v, want 1", got)
		})
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
	// reaches a request the engine finished while it still waits to write [DONE].
	s := startStack(t, sglangSims)
	p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	const n = 4
	var wg sync.WaitGroup
	lastToken := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/completions",
				strings.NewReader(`{"model":"sim","prompt":"p","max_tokens":1,"ignore_eos":true,"stream":true}`))
			req.Header.Set("X-Request-Id", fmt.Sprintf("r5-%d", i))
			req.Header.Set(sim.HeaderSlowWrite, "400ms")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				lastToken <- err
				return
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			for {
				line, err := br.ReadString('\n')
				if err != nil {
					lastToken <- fmt.Errorf("stream ended before its last token: %w", err)
					return
				}
				if strings.Contains(line, `"finish_reason":"length"`) {
					lastToken <- nil
					return // and the client leaves
				}
			}
		})
	}
	wg.Wait()
	for range n {
		if err := <-lastToken; err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"})
		return got == n, fmt.Sprintf("aborts{stage=decoding} = %v, want %d", got, n)
	})
	// Each abort (and its repeat) found the request finished: counted, nothing freed twice.
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		ds := kv(t, d)
		return ds.LateEventsTotal >= n && ds.AbortedTotal == 0, "decoder: " + jsonString(ds)
	})
	testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
	noDamage(t, p, d)
	stillServes(t, s)
	s.assertQuiet(time.Second)
}

// bootstrapPortOf asks an SGLang prefiller for its bootstrap server's port.
func bootstrapPortOf(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url + "/server_info")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var info struct {
		Port int `json:"disaggregation_bootstrap_port"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil || info.Port == 0 {
		t.Fatalf("%s/server_info: port %d, %v", url, info.Port, err)
	}
	return info.Port
}

// deadURL is the URL of a port nothing listens on any more.
func deadURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	return "http://" + ln.Addr().String()
}

// sendAndRead sends a request and returns its status once its answer is read whole.
func sendAndRead(t *testing.T, url, body string, hdr ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp := post(t, ctx, url, body, hdr...)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, string(b)
}

// heldEngine is a backend that takes each leg and answers it only when told: with a status,
// or by dying (the connection cut without an answer, and every one after it, as an engine
// killed after it took the leg). Other calls (health, /abort_request) get a 200 while it lives.
type heldEngine struct {
	url     string
	legs    chan struct{}
	answers chan int
	dead    atomic.Bool
}

func newHeldEngine(t *testing.T) *heldEngine {
	h := &heldEngine{legs: make(chan struct{}, 8), answers: make(chan int, 8)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h.dead.Load() {
			panic(http.ErrAbortHandler) // cuts the connection
		}
		io.Copy(io.Discard, r.Body)
		if !strings.HasSuffix(r.URL.Path, "/completions") {
			return
		}
		h.legs <- struct{}{}
		select {
		case status := <-h.answers:
			if status == 0 {
				h.dead.Store(true)
				panic(http.ErrAbortHandler)
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			io.WriteString(w, `{"error":{"message":"injected","type":"internal_error","code":"injected"}}`)
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	h.url = srv.URL
	return h
}

// answer answers the leg it holds with status; 0 kills the engine instead.
func (h *heldEngine) answer(status int) { h.answers <- status }

func TestSGLangLostPrefillLegGetsTheWaitingDecoderAborted(t *testing.T) {
	// The decoder waits for its room up to SGLang's waiting timeout (300s) unless the proxy
	// aborts it when the prefill leg fails. The held prefiller's bootstrap server is a real
	// prefiller's, where the decoder waits for a room that no prefill will ever fill.
	body := `{"model":"sim","messages":[{"role":"user","content":"` + prompt(100) + `"}],"max_tokens":5,"stream":true}`
	for _, tc := range []struct {
		name   string
		status int
	}{
		{"the prefiller answers 500", http.StatusInternalServerError},
		{"the prefiller dies", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			boot := sglangEngine(t, "prefill", nil)
			hp := newHeldEngine(t)
			s := startStack(t, sglangSims, func(c *app.Config) {
				c.Sims = c.Sims[1:]
				c.Router.Backends = []routerconfig.BackendConfig{{Name: "held-prefiller", URL: hp.url, Role: routerconfig.RolePrefill,
					Engine: "sglang", BootstrapPort: bootstrapPortOf(t, boot)}}
				c.Router.Health.Interval = -1
			})
			d := s.m.SimURLs("decode")[0]
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			done := inBackground(t, ctx, s.url+"/v1/chat/completions", body)
			testutil.Recv(t, 2*time.Second, hp.legs, "the prefill leg")
			testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
				ds := kv(t, d)
				return ds.RoomsWaiting == 1, "decoder: " + jsonString(ds)
			})
			hp.answer(tc.status)
			if code := testutil.Recv(t, 2*time.Second, done, "the answer"); code != http.StatusBadGateway {
				t.Fatalf("answered %d, want 502", code)
			}
			testutil.WaitFor(t, time.Second, func() (bool, string) {
				ds := kv(t, d)
				return ds.AbortedTotal == 1 && sglangIdle(ds), "decoder: " + jsonString(ds)
			})
			testutil.WaitFor(t, time.Second, enginesIdle(t, boot))
			s.assertQuiet(3 * time.Second) // a dead prefiller's abort is tried for a second
		})
	}

	t.Run("the transfer fails: both legs answer 500, nothing stays held", func(t *testing.T) {
		s := startStack(t, sglangSims)
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		if code, b := sendAndRead(t, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(100)+`","max_tokens":5}`, sim.HeaderTransferFail, "true"); code != http.StatusBadGateway {
			t.Fatalf("answered %d %s, want 502", code, b)
		}
		testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		noDamage(t, p, d)
		s.assertQuiet(time.Second)
	})
}

func TestSGLangLostDecodeLegGetsThePrefillersRoomAborted(t *testing.T) {
	// With NIXL a prefiller holds a room nobody claims until it restarts: only the proxy's
	// abort of the prefill leg frees it.
	hd := newHeldEngine(t)
	s := startStack(t, sglangSims, func(c *app.Config) {
		c.Sims = c.Sims[:1]
		c.Router.Backends = []routerconfig.BackendConfig{{Name: "held-decoder", URL: hd.url, Role: routerconfig.RoleDecode, Engine: "sglang"}}
		c.Router.Health.Interval = -1
	})
	p := s.m.SimURLs("prefill")[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(100)+`","max_tokens":5,"stream":true}`)
	testutil.Recv(t, 2*time.Second, hd.legs, "the decode leg")
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		ps := kv(t, p)
		return ps.RoomsHeld == 1, "prefiller: " + jsonString(ps)
	})
	hd.answer(http.StatusServiceUnavailable)
	if code := testutil.Recv(t, 2*time.Second, done, "the answer"); code != http.StatusBadGateway {
		t.Fatalf("answered %d, want 502", code)
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		ps := kv(t, p)
		return ps.AbortedTotal == 1 && sglangIdle(ps), "prefiller: " + jsonString(ps)
	})
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		got := handoffs(t, s, "released")
		return got == 1, fmt.Sprintf("handoffs{released} = %v, want 1", got)
	})
	s.assertQuiet(time.Second)
}

func TestSGLangDeadDecoderDoesNotHoldUpThePrefillersAbort(t *testing.T) {
	// A decoder that is gone cannot claim the room, so nothing stops the prefiller's abort:
	// the room is freed at once, and counted released, not as a failed release.
	for _, tc := range []struct {
		name string
		// dead is the decoder's URL, and kill makes it fail once the prefiller p holds
		// the room (if the leg gets that far).
		dead func(t *testing.T) (url string, kill func(p string))
	}{
		{"the decoder dies after taking the leg", func(t *testing.T) (string, func(string)) {
			hd := newHeldEngine(t)
			return hd.url, func(p string) {
				testutil.Recv(t, 2*time.Second, hd.legs, "the decode leg")
				testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
					ps := kv(t, p)
					return ps.RoomsHeld == 1, "prefiller: " + jsonString(ps)
				})
				hd.answer(0)
			}
		}},
		{"the decoder cannot be reached", func(t *testing.T) (string, func(string)) { return deadURL(t), func(string) {} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url, kill := tc.dead(t)
			s := startStack(t, sglangSims, func(c *app.Config) {
				c.Sims = c.Sims[:1]
				c.Router.Backends = []routerconfig.BackendConfig{{Name: "dead-decoder", URL: url, Role: routerconfig.RoleDecode, Engine: "sglang"}}
				c.Router.Health.Interval = -1
			})
			p := s.m.SimURLs("prefill")[0]
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(100)+`","max_tokens":5,"stream":true}`)
			kill(p)
			if code := testutil.Recv(t, 2*time.Second, done, "the answer"); code != http.StatusBadGateway {
				t.Fatalf("answered %d, want 502", code)
			}
			testutil.WaitFor(t, time.Second, func() (bool, string) {
				ps := kv(t, p)
				return sglangIdle(ps), "prefiller: " + jsonString(ps)
			})
			testutil.WaitFor(t, time.Second, func() (bool, string) {
				r, f := handoffs(t, s, "released"), testutil.Value(t, s.m.Registry, "pdproxy_kv_release_failures_total", nil)
				return r == 1 && f == 0, fmt.Sprintf("handoffs{released} = %v, want 1; release failures %v, want 0", r, f)
			})
			s.assertQuiet(3 * time.Second)
		})
	}
}

func TestSGLangClientIDsThatArePrefixesOfEachOtherNeverAbortEachOther(t *testing.T) {
	// SGLang aborts every request whose rid starts with the one named: the engines know a
	// request by the proxy's own fixed-length id, never by the client's X-Request-Id.
	for _, tc := range []struct {
		name string
		at   func(p, d sim.KVStats) bool // when "a" is given up on, both in flight
	}{
		{"given up on while both wait for their rooms", func(p, d sim.KVStats) bool { return p.RunningRequests == 2 && d.RoomsWaiting == 2 }},
		{"given up on while both decode", func(p, d sim.KVStats) bool { return d.RunningRequests == 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, sglangSims, func(c *app.Config) {
				c.Sims[0].PrefillTime = 300 * time.Millisecond
				c.Sims[1].ITL = 2 * time.Millisecond
			})
			p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
			const tokens = 150
			body := fmt.Sprintf(`{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true}`, prompt(50), tokens)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			a := inBackground(t, ctx, s.url+"/v1/completions", body, "X-Request-Id", "a")
			type answer struct {
				code int
				body []byte
				err  error
			}
			ab := make(chan answer, 1)
			go func() {
				req, _ := http.NewRequest(http.MethodPost, s.url+"/v1/completions", strings.NewReader(body))
				req.Header.Set("X-Request-Id", "ab")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					ab <- answer{err: err}
					return
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				ab <- answer{resp.StatusCode, b, err}
			}()
			testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
				ps, ds := kv(t, p), kv(t, d)
				return tc.at(ps, ds), "prefiller " + jsonString(ps) + ", decoder " + jsonString(ds)
			})
			cancel()
			<-a
			got := testutil.Recv(t, 5*time.Second, ab, "the answer of ab")
			if got.err != nil || got.code != http.StatusOK {
				t.Fatalf("ab answered %d %q: %v", got.code, got.body, got.err)
			}
			if n, _, done := tokensOf(t, got.body, true); n != tokens || !done {
				t.Errorf("ab answered %d tokens (ended: %v), want all %d", n, done, tokens)
			}
			testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
			if ps, ds := kv(t, p), kv(t, d); ps.AbortedTotal+ds.AbortedTotal == 0 {
				t.Errorf("prefiller %s, decoder %s: a was never aborted", jsonString(ps), jsonString(ds))
			}
			s.assertQuiet(time.Second)
		})
	}
}

func TestSGLangAbortsCarryTheAdminKey(t *testing.T) {
	// The sims refuse /abort_request without their admin key (401): legs freed within a
	// second, long before the sims' own disconnect detection, prove that the proxy sent it.
	const key = "sglang-admin-key"
	keyed := func(c *app.Config) {
		for i := range c.Sims {
			c.Sims[i].AdminAPIKey = key
		}
	}
	t.Run("the sims refuse an abort without it", func(t *testing.T) {
		s := startStack(t, sglangSims, keyed)
		for _, u := range s.allSimURLs() {
			resp, err := http.Post(u+"/abort_request", "application/json", strings.NewReader(`{"rid":"x"}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("%s/abort_request without the key: %d, want 401", u, resp.StatusCode)
			}
		}
	})

	t.Run("a client leaving while the prefill computes gets both legs aborted", func(t *testing.T) {
		s := startStack(t, sglangSims, keyed, func(c *app.Config) { c.Sims[0].PrefillTime = 10 * time.Second })
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"hello","max_tokens":5}`, "X-Request-Id", "keyed")
		testutil.WaitFor(t, 2*time.Second, legsOf(t, s, "keyed", p, d, func(ps, ds sim.KVStats) bool {
			return ps.RunningRequests == 1 && ds.RoomsWaiting == 1
		}))
		cancel()
		<-done
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			ps, ds := kv(t, p), kv(t, d)
			return ps.AbortedTotal == 1 && ds.AbortedTotal == 1 && sglangIdle(ps) && sglangIdle(ds),
				"prefiller " + jsonString(ps) + ", decoder " + jsonString(ds)
		})
		if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_release_failures_total", nil); got != 0 {
			t.Errorf("release failures = %v", got)
		}
		s.assertQuiet(time.Second)
	})

	t.Run("a client leaving mid-stream gets its decode aborted", func(t *testing.T) {
		s := startStack(t, sglangSims, keyed, func(c *app.Config) { c.Sims[1].ITL = 5 * time.Millisecond })
		p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		resp := post(t, ctx, s.url+"/v1/completions", longStream)
		readDataLines(t, bufio.NewReader(resp.Body), 3)
		cancel()
		resp.Body.Close()
		testutil.WaitFor(t, time.Second, func() (bool, string) {
			ds := kv(t, d)
			return ds.AbortedTotal == 1 && sglangIdle(ds), "decoder: " + jsonString(ds)
		})
		testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
		s.assertQuiet(time.Second)
	})
}

// byLabel formats each series of a counter as label=value, for a log line.
func byLabel(t *testing.T, s *stack, name, label string) string {
	var parts []string
	for _, m := range testutil.Series(t, s.m.Registry, name, nil) {
		parts = append(parts, fmt.Sprintf("%s=%v", m.Labels[label], m.Value))
	}
	return strings.Join(parts, " ")
}

// TestSGLangGiveUpStorm sends requests of every shape a client mixes (streaming or not,
// completions or chat, a few batches), whose clients give up at random moments, to two
// SGLang prefillers and two decoders. Afterwards every engine is idle within a second of the
// last client: no block, room, hold or request left anywhere, though the engines notice a
// gone client only after 30s; and no request the client waited for failed.
// PDPROXY_SGLANG_STORM=N sets the number of requests (200 by default).
func TestSGLangGiveUpStorm(t *testing.T) {
	n := stormSize(t, "PDPROXY_SGLANG_STORM")
	s := startStack(t, func(c *app.Config) {
		p := app.SimConfig{Role: "prefill", Protocol: sim.ProtocolSGLang, DisconnectDelay: sglangDisconnectDelay,
			PrefillTime: 5 * time.Millisecond, PrefillPerToken: 10 * time.Microsecond, KVBlocks: 8192}
		d := app.SimConfig{Role: "decode", Protocol: sim.ProtocolSGLang, DisconnectDelay: sglangDisconnectDelay,
			ITL: 2 * time.Millisecond, KVTransferTime: 100 * time.Microsecond, KVBlocks: 8192}
		c.Sims = []app.SimConfig{p, p, d, d}
	})
	kinds := []stormKind{
		{"completion", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true}`},
		{"completion stream", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"ignore_eos":true}`},
		{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"completion", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d}`},
		{"completion stream", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"stream":true}`},
		{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d}`},
		{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}`},
		{"batch", "/v1/completions", `{"model":"sim","prompt":["%s","second","third"],"max_tokens":%d,"ignore_eos":true}`},
		{"batch stream", "/v1/completions", `{"model":"sim","prompt":["%s","second"],"max_tokens":%d,"ignore_eos":true,"stream":true}`},
	}
	outcomes, done := giveUpStorm(t, s.url, kinds, n, 12)

	for k, v := range outcomes {
		if !strings.HasSuffix(k, ": 200") && !strings.Contains(k, "gave up") {
			t.Errorf("a request the client waited for failed: %s %d", k, v)
		}
	}
	logOutcomes(t, n, outcomes)

	sims := s.allSimURLs()
	testutil.WaitFor(t, time.Second, enginesIdle(t, sims...))
	t.Logf("every engine idle %s after the last client was done", time.Since(done).Round(time.Millisecond))
	s.assertQuiet(5 * time.Second)

	reg := s.m.Registry
	t.Logf("aborts by stage: %s", byLabel(t, s, "pdproxy_aborts_total", "stage"))
	t.Logf("holds by result: %s", byLabel(t, s, "pdproxy_kv_hold_handoffs_total", "result"))
	t.Logf("releases by reason: %s; release failures: %v", byLabel(t, s, "pdproxy_kv_releases_total", "reason"),
		testutil.Value(t, reg, "pdproxy_kv_release_failures_total", nil))
	// Every engine answered: every room was taken by its decoder or freed by an abort.
	if got := handoffs(t, s, "left_to_engine"); got != 0 {
		t.Errorf("handoffs{left_to_engine} = %v, want 0", got)
	}
	if got := testutil.Value(t, reg, "pdproxy_kv_release_failures_total", nil); got != 0 {
		t.Errorf("release failures = %v, want 0", got)
	}
	for _, role := range []string{"prefill", "decode"} {
		for i, u := range s.m.SimURLs(role) {
			st := kv(t, u)
			t.Logf("%s %d: requests %d, aborted %d, holds %d, remote prefills %d, late events %d, double frees %d, crashes %d",
				role, i, st.RequestsTotal, st.AbortedTotal, st.HoldsTotal, st.RemotePrefillRequestsTotal, st.LateEventsTotal, st.DoubleFreeAttemptsTotal, st.EngineCrashesTotal)
		}
	}
	noDamage(t, sims...)
}
