package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// sglangConfig is a fast SGLang engine of role on a free bootstrap port that aborts a gone
// client's request at once.
func sglangConfig(role string) Config {
	cfg := fastConfig()
	cfg.Protocol, cfg.Role = ProtocolSGLang, role
	cfg.BootstrapPort = 0
	cfg.DisconnectDelay = 0
	return cfg
}

// startSGLang is startServer stopping the engine before its HTTP server: the engine's
// shutdown answers every leg still waiting for a room, so that a failing test never hangs
// in the server's Close, which waits for its handlers.
func startSGLang(t *testing.T, cfg Config) *testServer {
	t.Helper()
	e, err := New(cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	ts := &testServer{e: e, srv: httptest.NewServer(e.Handler()), client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		ts.srv.Close()
		ts.client.CloseIdleConnections()
	})
	return ts
}

// sgPair is an SGLang prefiller and decoder, and the prefiller's bootstrap port as the
// proxy reads it.
type sgPair struct {
	p, d *testServer
	port int
}

func startPair(t *testing.T, pcfg, dcfg Config) *sgPair {
	t.Helper()
	pr := &sgPair{p: startSGLang(t, pcfg), d: startSGLang(t, dcfg)}
	bs, err := engine.SGLang.Bootstrap(context.Background(), pr.p.client, pr.p.srv.URL, 0)
	if err != nil {
		t.Fatalf("bootstrap port: %v", err)
	}
	pr.port = bs.Port
	return pr
}

// leg is body as the proxy sends it to both legs (engine.SGLang.Legs).
func (pr *sgPair) leg(t *testing.T, body, rid string, room uint64, prompts int) string {
	t.Helper()
	f, err := engine.ParseFields([]byte(body))
	if err != nil {
		t.Fatalf("parse %s: %v", body, err)
	}
	calls, err := engine.SGLang.Legs(f, engine.Leg{Host: "127.0.0.1", Port: pr.port, Room: room, RID: rid, Prompts: prompts, Rank: -1})
	if err != nil {
		t.Fatalf("leg body: %v", err)
	}
	return string(calls.Decode)
}

// answer is an HTTP answer read whole by a goroutine.
type answer struct {
	status int
	body   string
	err    error
}

// send posts body in the background; the answer comes on the channel.
func (ts *testServer) send(ctx context.Context, path, body string, hdr map[string]string) <-chan answer {
	out := make(chan answer, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.srv.URL+path, strings.NewReader(body))
		if err != nil {
			out <- answer{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := ts.client.Do(req)
		if err != nil {
			out <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		out <- answer{status: resp.StatusCode, body: string(b), err: err}
	}()
	return out
}

func recvAnswer(t *testing.T, ch <-chan answer, what string) answer {
	t.Helper()
	a := testutil.Recv(t, testutil.Timeout, ch, "%s", what)
	if a.err != nil {
		t.Fatalf("%s: %v", what, a.err)
	}
	return a
}

// abort posts an SGLang abort and checks its 200 with an empty body.
func (ts *testServer) abort(t *testing.T, rid string, all bool) {
	t.Helper()
	resp := ts.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q,"abort_all":%t}`, rid, all), nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK || len(b) != 0 {
		t.Fatalf("abort %q: status %d, body %q; want 200 and an empty body", rid, resp.StatusCode, b)
	}
}

// postOK posts body to url and returns the answer of a 200.
func postOK(t *testing.T, client *http.Client, url, body string) []byte {
	t.Helper()
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	b := readAll(t, resp)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: status %d: %s", url, resp.StatusCode, b)
	}
	return b
}

// waiters is how many decoders wait in a claim for room on a prefiller.
func waiters(e *Engine, room uint64) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if rm := e.rooms[room]; rm != nil {
		return rm.waiters
	}
	return 0
}

func roomsKnown(e *Engine) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.rooms)
}

func sglangDone(s KVStats) bool { return allFree(s) && s.RoomsWaiting == 0 && s.RoomsHeld == 0 }

// checkClean waits until both engines hold nothing and checks that nothing went wrong.
func (pr *sgPair) checkClean(t *testing.T) {
	t.Helper()
	for name, ts := range map[string]*testServer{"prefiller": pr.p, "decoder": pr.d} {
		s := ts.waitKV(t, name+" frees everything", sglangDone)
		if s.DoubleFreeAttemptsTotal != 0 || s.EngineCrashesTotal != 0 {
			t.Errorf("%s /debug/kv = %+v, want no double frees or crashes", name, s)
		}
	}
	// A claim withdrawn by a decoder leaves the room once its handler sees the connection close.
	testutil.Eventually(t, testutil.Timeout, func() bool { return roomsKnown(pr.p.e) == 0 }, "the prefiller to forget every room")
}

// abortedAnswer checks a non-streaming answer that ends with finish_reason "abort".
func abortedAnswer(t *testing.T, a answer, what string) {
	t.Helper()
	if a.status != http.StatusOK || !strings.Contains(a.body, `"finish_reason":"abort"`) {
		t.Errorf("%s answered %d %s, want 200 with finish_reason abort", what, a.status, a.body)
	}
}

// errorAnswer checks an OpenAI error answer of status and code.
func errorAnswer(t *testing.T, a answer, status int, code, what string) {
	t.Helper()
	if a.status != status || !strings.Contains(a.body, `"code":"`+code+`"`) {
		t.Errorf("%s answered %d %s, want %d with code %s", what, a.status, a.body, status, code)
	}
}

func TestSGLangServerInfoReportsTheModeAndTheBootstrapPort(t *testing.T) {
	pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
	vllm := startServer(t, fastConfig())
	if pr.port != pr.p.e.boot.port() || pr.port == 0 {
		t.Errorf("the proxy read bootstrap port %d, the prefiller listens on %d", pr.port, pr.p.e.boot.port())
	}
	tests := []struct {
		name     string
		ts       *testServer
		mode     string
		wantPort bool
	}{
		{"an sglang prefiller reports its bootstrap port", pr.p, "prefill", true},
		{"an sglang decoder reports no port", pr.d, "decode", false},
		{"a vllm sim is not disaggregated the SGLang way", vllm, "null", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, path := range []string{"/server_info", "/get_server_info"} {
				var info struct {
					Mode string `json:"disaggregation_mode"`
					Port *int   `json:"disaggregation_bootstrap_port"`
				}
				if err := json.Unmarshal(tt.ts.get(t, path), &info); err != nil {
					t.Fatal(err)
				}
				if info.Mode != tt.mode || (info.Port != nil) != tt.wantPort || (tt.wantPort && *info.Port != pr.port) {
					t.Errorf("%s: mode %q, port %v; want %q, port %v", path, info.Mode, info.Port, tt.mode, tt.wantPort)
				}
			}
		})
	}
	if _, err := engine.SGLang.Bootstrap(context.Background(), pr.d.client, pr.d.srv.URL, 0); err == nil {
		t.Error("the proxy took a decoder for a prefiller")
	}
}

func TestSGLangRequestOverTheBootstrapRoomIsServedByTheDecoderAndFreesBothEngines(t *testing.T) {
	prompt := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks of 16
	tests := []struct {
		name    string
		path    string
		body    string
		prompts int
		order   string // "prefill first", "decode first" or "together"
		stream  bool
	}{
		{"completions, the prefill leg first", "/v1/completions",
			`{"model":"sim","prompt":"` + prompt + `","max_tokens":8,"ignore_eos":true}`, 1, "prefill first", false},
		{"completions streamed, the decode leg first", "/v1/completions",
			`{"model":"sim","prompt":"` + prompt + `","max_tokens":8,"ignore_eos":true,"stream":true}`, 1, "decode first", true},
		{"chat streamed with usage, both legs together", "/v1/chat/completions",
			`{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":8,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, 1, "together", true},
		{"responses streamed, both legs together", "/v1/responses",
			`{"model":"sim","input":"` + prompt + `","max_output_tokens":8,"ignore_eos":true,"stream":true}`, 1, "together", true},
		{"two prompts, two rooms", "/v1/completions",
			`{"prompt":["` + prompt + `","` + prompt + `"],"max_tokens":8,"ignore_eos":true}`, 2, "together", false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
			rid := fmt.Sprintf("req-%04d", i)
			body := pr.leg(t, tt.body, rid, uint64(1000+i), tt.prompts)
			var pLeg, dLeg <-chan answer
			switch tt.order {
			case "prefill first":
				pLeg = pr.p.send(context.Background(), tt.path, body, nil)
				pr.p.waitKV(t, "the prefiller holds the room", func(s KVStats) bool { return s.RoomsHeld == 1 })
				dLeg = pr.d.send(context.Background(), tt.path, body, nil)
			case "decode first":
				dLeg = pr.d.send(context.Background(), tt.path, body, nil)
				pr.d.waitKV(t, "the decoder waits for the room", func(s KVStats) bool { return s.RoomsWaiting == 1 })
				pLeg = pr.p.send(context.Background(), tt.path, body, nil)
			default:
				pLeg = pr.p.send(context.Background(), tt.path, body, nil)
				dLeg = pr.d.send(context.Background(), tt.path, body, nil)
			}
			d := recvAnswer(t, dLeg, "the decoder's answer")
			p := recvAnswer(t, pLeg, "the prefiller's answer")
			if d.status != http.StatusOK || p.status != http.StatusOK {
				t.Fatalf("decoder %d %s\nprefiller %d %s", d.status, d.body, p.status, p.body)
			}
			rids := []string{rid}
			if tt.prompts > 1 {
				rids = []string{rid + "-0000", rid + "-0001"}
			}
			if tt.stream {
				events := sseEvents(t, []byte(d.body))
				if text, finish := streamText(t, events); text != expectedText(0, rid, 8) || finish != "length" {
					t.Errorf("decoder streamed %q (%s), want %q", text, finish, expectedText(0, rid, 8))
				}
				if text, _ := streamText(t, sseEvents(t, []byte(p.body))); text != expectedText(0, rid, 1) {
					t.Errorf("prefiller streamed %q, want its one token %q", text, expectedText(0, rid, 1))
				}
			} else {
				var dc, pc struct {
					Choices []struct {
						Index        int    `json:"index"`
						Text         string `json:"text"`
						FinishReason string `json:"finish_reason"`
					} `json:"choices"`
					Usage usage `json:"usage"`
				}
				if err := json.Unmarshal([]byte(d.body), &dc); err != nil || len(dc.Choices) != len(rids) {
					t.Fatalf("decoder answered %s (%v), want %d choices", d.body, err, len(rids))
				}
				if err := json.Unmarshal([]byte(p.body), &pc); err != nil || len(pc.Choices) != len(rids) {
					t.Fatalf("prefiller answered %s (%v), want %d choices", p.body, err, len(rids))
				}
				for j, r := range rids {
					if c := dc.Choices[j]; c.Index != j || c.Text != expectedText(0, r, 8) || c.FinishReason != "length" {
						t.Errorf("decoder choice %d = %+v, want %q", j, c, expectedText(0, r, 8))
					}
					if c := pc.Choices[j]; c.Text != expectedText(0, r, 1) {
						t.Errorf("prefiller choice %d = %+v, want its one token %q", j, c, expectedText(0, r, 1))
					}
				}
				if pc.Usage.CompletionTokens != len(rids) || dc.Usage.CompletionTokens != 8*len(rids) {
					t.Errorf("usage: prefiller %+v, decoder %+v", pc.Usage, dc.Usage)
				}
				if strings.Contains(p.body, "kv_transfer_params") || strings.Contains(d.body, "kv_transfer_params") {
					t.Errorf("an SGLang answer carries kv_transfer_params:\n%s\n%s", p.body, d.body)
				}
			}
			pr.checkClean(t)
			ps, ds := pr.p.kv(t), pr.d.kv(t)
			if ps.HoldsTotal != len(rids) || ds.HoldsTotal != 0 || ds.RemotePrefillRequestsTotal != 1 || ps.RemotePrefillRequestsTotal != 0 {
				t.Errorf("holds_total P %d D %d, remote_prefill_requests_total P %d D %d; want %d, 0, 0, 1",
					ps.HoldsTotal, ds.HoldsTotal, ps.RemotePrefillRequestsTotal, ds.RemotePrefillRequestsTotal, len(rids))
			}
			for name, s := range map[string]KVStats{"P": ps, "D": ds} {
				if s.LateEventsTotal != 0 || s.AbortedTotal != 0 || s.ExpiredTotal != 0 {
					t.Errorf("%s /debug/kv = %+v, want no late events, aborts or expiries", name, s)
				}
			}
		})
	}
}

func TestSGLangAbortMatchesEveryRequestWhoseRidStartsWithIt(t *testing.T) {
	tests := []struct {
		name     string
		inFlight []string // decodes waiting for rooms that never come
		rid      string
		all      bool
		aborted  []string
		late     int
	}{
		{name: "aborting abc aborts abc and abcd", inFlight: []string{"abc", "abcd", "xyz"}, rid: "abc", aborted: []string{"abc", "abcd"}},
		{name: "aborting abcd leaves abc", inFlight: []string{"abc", "abcd"}, rid: "abcd", aborted: []string{"abcd"}},
		{
			// SGLang's tokenizer manager forwards an abort only for a rid it serves.
			name: "aborting abc when only abcd is in flight does nothing", inFlight: []string{"abcd"}, rid: "abc", late: 1,
		},
		{name: "an unknown rid is a counted no-op", inFlight: []string{"abc"}, rid: "nobody", late: 1},
		{name: "abort_all aborts every request", inFlight: []string{"abc", "xyz"}, all: true, aborted: []string{"abc", "xyz"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
			legs := map[string]<-chan answer{}
			for i, rid := range tt.inFlight {
				legs[rid] = pr.d.send(context.Background(), "/v1/completions", pr.leg(t, `{"prompt":"hi"}`, rid, uint64(i), 1), nil)
			}
			pr.d.waitKV(t, "every decode waits for its room", func(s KVStats) bool { return s.RoomsWaiting == len(tt.inFlight) })
			pr.d.abort(t, tt.rid, tt.all)
			for _, rid := range tt.aborted {
				abortedAnswer(t, recvAnswer(t, legs[rid], rid), rid)
				delete(legs, rid)
			}
			s := pr.d.waitKV(t, "the aborted rooms are no longer waited for", func(s KVStats) bool {
				return s.RoomsWaiting == len(legs) && s.LateEventsTotal == tt.late
			})
			if s.AbortedTotal != len(tt.aborted) {
				t.Errorf("aborted_total %d, want %d", s.AbortedTotal, len(tt.aborted))
			}
			for rid, leg := range legs {
				select {
				case a := <-leg:
					t.Errorf("%s ended (%d %s) though not aborted", rid, a.status, a.body)
				default:
				}
			}
			pr.d.abort(t, "", true)
			for rid, leg := range legs {
				abortedAnswer(t, recvAnswer(t, leg, rid), rid)
			}
			pr.checkClean(t)
		})
	}
}

func TestSGLangAbortOfEitherLegAtEachStageLeavesEveryBlockFree(t *testing.T) {
	const room = 7
	body := `{"prompt":"` + strings.Repeat("abcd", 40) + `","max_tokens":8,"ignore_eos":true}`
	slowPrefill := sglangConfig("prefill")
	slowPrefill.PrefillTime = time.Hour

	t.Run("a decode waiting for its room", func(t *testing.T) {
		pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
		d := pr.d.send(context.Background(), "/v1/completions", pr.leg(t, body, "r", room, 1), nil)
		pr.d.waitKV(t, "the decode waits", func(s KVStats) bool { return s.RoomsWaiting == 1 })
		pr.d.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, d, "decode"), "decode")
		pr.checkClean(t)
	})

	t.Run("a prefill computing: its decode fails", func(t *testing.T) {
		pr := startPair(t, slowPrefill, sglangConfig("decode"))
		leg := pr.leg(t, body, "r", room, 1)
		d := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		p := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		testutil.Eventually(t, testutil.Timeout, func() bool { return waiters(pr.p.e, room) == 1 }, "the decoder's claim at the prefiller")
		pr.p.waitKV(t, "the prefill computes", func(s KVStats) bool { return s.RunningRequests == 1 })
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		errorAnswer(t, recvAnswer(t, d, "decode"), http.StatusInternalServerError, "kv_transfer_failed", "decode")
		pr.checkClean(t)
	})

	t.Run("a room held before any decoder came", func(t *testing.T) {
		pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
		p := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "r", room, 1), nil)
		pr.p.waitKV(t, "the room is held", func(s KVStats) bool { return s.RoomsHeld == 1 && s.BlocksHeld == 3 })
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		pr.checkClean(t)
	})

	t.Run("the proxy's order: the decode waiting, then the prefill computing", func(t *testing.T) {
		pr := startPair(t, slowPrefill, sglangConfig("decode"))
		leg := pr.leg(t, body, "r", room, 1)
		d := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		p := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		testutil.Eventually(t, testutil.Timeout, func() bool { return waiters(pr.p.e, room) == 1 }, "the decoder's claim at the prefiller")
		pr.p.waitKV(t, "the prefill computes", func(s KVStats) bool { return s.RunningRequests == 1 })
		pr.d.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, d, "decode"), "decode")
		testutil.Eventually(t, testutil.Timeout, func() bool { return waiters(pr.p.e, room) == 0 }, "the claim withdrawn")
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		pr.checkClean(t)
	})

	t.Run("a decode given the room's KV but not yet reading it: the prefiller holds the room until its own abort", func(t *testing.T) {
		dcfg := sglangConfig("decode")
		dcfg.NIXLHandshakeDelay = time.Hour // the decode has its blocks and waits to read
		pr := startPair(t, sglangConfig("prefill"), dcfg)
		leg := pr.leg(t, body, "r", room, 1)
		p := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		d := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		pr.d.waitKV(t, "the decode has its blocks", func(s KVStats) bool { return s.RunningRequests == 1 && s.BlocksInUse == 3 })
		pr.d.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, d, "decode"), "decode")
		pr.d.waitKV(t, "the decoder frees", sglangDone)
		// With NIXL nobody tells the prefiller: the room stays held.
		if s := barrier(t, pr.p); s.HeldRequests != 1 || s.RoomsHeld != 1 || s.BlocksHeld != 3 {
			t.Errorf("prefiller /debug/kv = %+v, want the room still held", s)
		}
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		pr.checkClean(t)
	})

	t.Run("a decode decoding after its transfer", func(t *testing.T) {
		dcfg := sglangConfig("decode")
		dcfg.ITL = time.Hour // one token, then a long wait
		pr := startPair(t, sglangConfig("prefill"), dcfg)
		leg := pr.leg(t, strings.Replace(body, `"ignore_eos":true`, `"ignore_eos":true,"stream":true`, 1), "r", room, 1)
		p := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		d := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		if a := recvAnswer(t, p, "prefill"); a.status != http.StatusOK || !strings.HasSuffix(a.body, "data: [DONE]\n\n") {
			t.Errorf("prefill answered %d %q once the transfer was done, want a stream ending [DONE]", a.status, a.body)
		}
		pr.d.waitKV(t, "the decode decodes", func(s KVStats) bool { return s.RunningRequests == 1 })
		pr.d.abort(t, "r", false)
		if a := recvAnswer(t, d, "decode"); !strings.Contains(a.body, `"finish_reason":"abort"`) {
			t.Errorf("decode stream %q does not end with finish_reason abort", a.body)
		}
		pr.checkClean(t)
	})

	t.Run("a prefill whose room is being transferred answers at once and frees when the transfer ends", func(t *testing.T) {
		pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
		p := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "r", room, 1), nil)
		pr.p.waitKV(t, "the room is held", func(s KVStats) bool { return s.RoomsHeld == 1 })
		// The decoder's side by hand: claim the room, start the read.
		boot := fmt.Sprintf("http://127.0.0.1:%d", pr.port)
		var kv claimResponse
		if err := json.Unmarshal(postOK(t, pr.p.client, boot+"/bootstrap/claim", fmt.Sprintf(`{"room":%d,"rid":"r"}`, room)), &kv); err != nil || len(kv.BlockIDs) != 3 {
			t.Fatalf("claim: %+v, %v", kv, err)
		}
		pull, _ := json.Marshal(pullRequest{EngineID: kv.EngineID, RequestID: kv.RequestID, BlockIDs: kv.BlockIDs})
		postOK(t, pr.p.client, boot+"/kv/pull", string(pull))
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		if s := barrier(t, pr.p); s.HeldRequests != 1 || s.BlocksHeld != 3 || s.RoomsHeld != 0 {
			t.Errorf("prefiller /debug/kv = %+v, want the blocks held until the transfer ends", s)
		}
		postOK(t, pr.p.client, boot+"/kv/notify", string(pull))
		pr.checkClean(t)
		if s := pr.p.kv(t); s.AbortedTotal != 1 || s.LateEventsTotal != 1 {
			t.Errorf("prefiller /debug/kv = %+v, want one abort, no late event but the barrier's", s)
		}
	})

	t.Run("rooms of every rid starting with the aborted one, on a prefiller", func(t *testing.T) {
		pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
		p1 := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "abc", 1, 1), nil)
		p2 := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "abcd", 2, 1), nil)
		pr.p.waitKV(t, "both rooms held", func(s KVStats) bool { return s.RoomsHeld == 2 })
		pr.p.abort(t, "abc", false)
		abortedAnswer(t, recvAnswer(t, p1, "abc"), "abc")
		abortedAnswer(t, recvAnswer(t, p2, "abcd"), "abcd")
		pr.checkClean(t)
	})
}

// watchedClock is a fake clock that reports the duration of every timer made on it, so
// that a test moves it only once the timer it means to fire exists.
type watchedClock struct {
	*fakeClock
	made chan time.Duration
}

func newWatchedClock() *watchedClock {
	return &watchedClock{fakeClock: newFakeClock(), made: make(chan time.Duration, 1<<12)}
}

func (c *watchedClock) NewTimer(d time.Duration) Timer {
	t := c.fakeClock.NewTimer(d)
	select {
	case c.made <- d:
	default:
	}
	return t
}

// waitTimer waits until a timer of d has been made.
func (c *watchedClock) waitTimer(t *testing.T, d time.Duration) {
	t.Helper()
	deadline := time.After(testutil.Timeout)
	for {
		select {
		case got := <-c.made:
			if got == d {
				return
			}
		case <-deadline:
			t.Fatalf("no timer of %s was made", d)
		}
	}
}

func TestSGLangDecodeWaitingForARoomThatNeverComesFailsAtTheWaitingTimeout(t *testing.T) {
	if DefaultConfig().WaitingTimeout != 300*time.Second {
		t.Fatalf("default waiting timeout %s, want SGLang's 300s", DefaultConfig().WaitingTimeout)
	}
	clock := newWatchedClock()
	dcfg := sglangConfig("decode")
	dcfg.Clock, dcfg.WaitingTimeout = clock, 0 // the default
	pr := startPair(t, sglangConfig("prefill"), dcfg)
	d := pr.d.send(context.Background(), "/v1/completions", pr.leg(t, `{"prompt":"hi"}`, "r", 1, 1), nil)
	pr.d.waitKV(t, "the decode waits", func(s KVStats) bool { return s.RoomsWaiting == 1 })
	clock.Advance(300*time.Second - time.Nanosecond)
	if s := barrier(t, pr.d); s.RoomsWaiting != 1 {
		t.Errorf("before the timeout rooms_waiting = %d, want 1", s.RoomsWaiting)
	}
	clock.Advance(time.Nanosecond)
	errorAnswer(t, recvAnswer(t, d, "decode"), http.StatusInternalServerError, "kv_transfer_timeout", "decode")
	pr.checkClean(t)
}

func TestSGLangRoomNobodyClaimsIsHeldUntilAbortedOrTheBootstrapTimeout(t *testing.T) {
	body := `{"prompt":"` + strings.Repeat("abcd", 40) + `","ignore_eos":true}`
	t.Run("without a bootstrap timeout the room outlives a day, then an abort frees it", func(t *testing.T) {
		clock := newWatchedClock()
		pcfg := sglangConfig("prefill")
		pcfg.Clock, pcfg.PrefillTime, pcfg.ITL = clock, 0, 0
		pr := startPair(t, pcfg, sglangConfig("decode"))
		p := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "r", 1, 1), nil)
		pr.p.waitKV(t, "the room is held", func(s KVStats) bool { return s.RoomsHeld == 1 })
		clock.Advance(24 * time.Hour)
		// Any request makes the scheduler step at the new time, expiries included.
		resp := pr.p.post(t, context.Background(), "/v1/completions", `{"prompt":"x","max_tokens":1}`, nil)
		if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("plain request: %d %s", resp.StatusCode, b)
		}
		if s := pr.p.kv(t); s.RoomsHeld != 1 || s.BlocksHeld != 3 || s.ExpiredTotal != 0 {
			t.Errorf("a day later /debug/kv = %+v, want the room held", s)
		}
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		pr.checkClean(t)
	})
	t.Run("with --bootstrap-timeout the room is freed and its leg fails", func(t *testing.T) {
		clock := newWatchedClock()
		pcfg := sglangConfig("prefill")
		pcfg.Clock, pcfg.PrefillTime, pcfg.BootstrapTimeout = clock, 0, 10*time.Second
		pr := startPair(t, pcfg, sglangConfig("decode"))
		p := pr.p.send(context.Background(), "/v1/completions", pr.leg(t, body, "r", 1, 1), nil)
		pr.p.waitKV(t, "the room is held", func(s KVStats) bool { return s.RoomsHeld == 1 })
		clock.Advance(10*time.Second - time.Nanosecond)
		if s := barrier(t, pr.p); s.RoomsHeld != 1 {
			t.Errorf("before the timeout /debug/kv = %+v, want the room held", s)
		}
		clock.Advance(time.Nanosecond)
		errorAnswer(t, recvAnswer(t, p, "prefill"), http.StatusInternalServerError, "bootstrap_timeout", "prefill")
		pr.checkClean(t)
		if s := pr.p.kv(t); s.ExpiredTotal != 1 {
			t.Errorf("expired_total = %d, want 1", s.ExpiredTotal)
		}
	})
	t.Run("a room a decoder asked for has no bootstrap timeout", func(t *testing.T) {
		clock := newWatchedClock()
		pcfg := sglangConfig("prefill")
		pcfg.Clock, pcfg.PrefillTime, pcfg.BootstrapTimeout = clock, 0, 10*time.Second
		dcfg := sglangConfig("decode")
		dcfg.NIXLHandshakeDelay = time.Hour
		pr := startPair(t, pcfg, dcfg)
		leg := pr.leg(t, body, "r", 1, 1)
		p := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		d := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		pr.d.waitKV(t, "the decode has the room's KV", func(s KVStats) bool { return s.RunningRequests == 1 })
		clock.Advance(time.Hour)
		if s := barrier(t, pr.p); s.HeldRequests != 1 || s.ExpiredTotal != 0 {
			t.Errorf("/debug/kv = %+v, want the room held past the bootstrap timeout", s)
		}
		pr.d.abort(t, "r", false)
		pr.p.abort(t, "r", false)
		abortedAnswer(t, recvAnswer(t, d, "decode"), "decode")
		abortedAnswer(t, recvAnswer(t, p, "prefill"), "prefill")
		pr.checkClean(t)
	})
}

func TestSGLangDisconnectIsNoticedOnlyAfterTheDisconnectDelay(t *testing.T) {
	if DefaultConfig().DisconnectDelay != 2*time.Second {
		t.Fatalf("default disconnect delay %s, want 2s", DefaultConfig().DisconnectDelay)
	}
	body := `{"prompt":"hi","stream":true}`
	t.Run("the request is aborted a delay after its client left", func(t *testing.T) {
		clock := newWatchedClock()
		dcfg := sglangConfig("decode")
		dcfg.Clock, dcfg.DisconnectDelay = clock, 2*time.Second
		pr := startPair(t, sglangConfig("prefill"), dcfg)
		ctx, cancel := context.WithCancel(context.Background())
		d := pr.d.send(ctx, "/v1/completions", pr.leg(t, body, "r", 1, 1), nil)
		pr.d.waitKV(t, "the decode waits", func(s KVStats) bool { return s.RoomsWaiting == 1 })
		cancel()
		if a := testutil.Recv(t, testutil.Timeout, d, "the client's end"); a.err == nil {
			t.Fatalf("the client got %d %s, want its own cancellation", a.status, a.body)
		}
		clock.waitTimer(t, 2*time.Second)
		clock.Advance(2*time.Second - time.Nanosecond)
		if s := barrier(t, pr.d); s.RoomsWaiting != 1 {
			t.Errorf("within the delay rooms_waiting = %d, want 1", s.RoomsWaiting)
		}
		clock.Advance(time.Nanosecond)
		pr.checkClean(t)
	})
	t.Run("an explicit abort frees it at once", func(t *testing.T) {
		dcfg := sglangConfig("decode")
		dcfg.DisconnectDelay = time.Hour
		pr := startPair(t, sglangConfig("prefill"), dcfg)
		ctx, cancel := context.WithCancel(context.Background())
		d := pr.d.send(ctx, "/v1/completions", pr.leg(t, body, "r", 1, 1), nil)
		pr.d.waitKV(t, "the decode waits", func(s KVStats) bool { return s.RoomsWaiting == 1 })
		cancel()
		testutil.Recv(t, testutil.Timeout, d, "the client's end")
		if s := barrier(t, pr.d); s.RoomsWaiting != 1 {
			t.Errorf("after the disconnect rooms_waiting = %d, want 1 (noticed an hour later)", s.RoomsWaiting)
		}
		pr.d.abort(t, "r", false) // the rid is still in flight: its handler lingers
		pr.checkClean(t)
	})
	t.Run("no delay: the request is aborted when its client leaves", func(t *testing.T) {
		pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
		ctx, cancel := context.WithCancel(context.Background())
		d := pr.d.send(ctx, "/v1/completions", pr.leg(t, body, "r", 1, 1), nil)
		pr.d.waitKV(t, "the decode waits", func(s KVStats) bool { return s.RoomsWaiting == 1 })
		cancel()
		testutil.Recv(t, testutil.Timeout, d, "the client's end")
		pr.checkClean(t)
	})
}

func TestSGLangAbortNeedsTheAdminKeyWhenOneIsSet(t *testing.T) {
	cfg := sglangConfig("decode")
	cfg.AdminAPIKey = "sekret"
	ts := startSGLang(t, cfg)
	vcfg := fastConfig()
	vcfg.AdminAPIKey = "sekret"
	vllm := startServer(t, vcfg)
	tests := []struct {
		name   string
		ts     *testServer
		auth   string
		status int
	}{
		{"no key is a 401", ts, "", http.StatusUnauthorized},
		{"a wrong key is a 401", ts, "Bearer wrong", http.StatusUnauthorized},
		{"the key without Bearer is a 401", ts, "sekret", http.StatusUnauthorized},
		{"the admin key is a 200", ts, "Bearer sekret", http.StatusOK},
		{"a vllm sim with a key wants it too", vllm, "", http.StatusUnauthorized},
		{"a vllm sim takes its key", vllm, "Bearer sekret", http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hdr := map[string]string{}
			if tt.auth != "" {
				hdr["Authorization"] = tt.auth
			}
			resp := tt.ts.post(t, context.Background(), "/abort_request", `{"rid":"x","abort_all":false}`, hdr)
			if b := readAll(t, resp); resp.StatusCode != tt.status {
				t.Errorf("status %d (%s), want %d", resp.StatusCode, b, tt.status)
			}
		})
	}
	if s := ts.kv(t); s.LateEventsTotal != 1 {
		t.Errorf("late_events_total = %d, want 1: only the authorized abort reached the engine", s.LateEventsTotal)
	}
	// The proxy's own call, with the key its backend config gives it.
	client := &http.Client{Transport: &bearer{key: "sekret", next: ts.client.Transport}}
	if err := engine.SGLang.(engine.Aborter).Abort(context.Background(), client, ts.srv.URL, "y"); err != nil {
		t.Errorf("the proxy's abort with the admin key: %v", err)
	}
}

type bearer struct {
	key  string
	next http.RoundTripper
}

func (b *bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.key)
	return b.next.RoundTrip(r)
}

func TestSGLangTransferFaultFailsBothLegsAndFreesTheRoom(t *testing.T) {
	body := `{"prompt":"` + strings.Repeat("abcd", 40) + `","max_tokens":4}`
	tests := []struct {
		name         string
		pFlag, dFlag bool
		pHdr, dHdr   map[string]string
	}{
		{name: "X-Sim-Transfer-Fail on the decode leg", dHdr: map[string]string{HeaderTransferFail: "true"}},
		{name: "X-Sim-Transfer-Fail on the prefill leg", pHdr: map[string]string{HeaderTransferFail: "1"}},
		{name: "--transfer-fail on the decoder", dFlag: true},
		{name: "--transfer-fail on the prefiller", pFlag: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pcfg, dcfg := sglangConfig("prefill"), sglangConfig("decode")
			pcfg.TransferFail, dcfg.TransferFail = tt.pFlag, tt.dFlag
			pr := startPair(t, pcfg, dcfg)
			leg := pr.leg(t, body, "r", 1, 1)
			p := pr.p.send(context.Background(), "/v1/completions", leg, tt.pHdr)
			d := pr.d.send(context.Background(), "/v1/completions", leg, tt.dHdr)
			errorAnswer(t, recvAnswer(t, d, "decode"), http.StatusInternalServerError, "kv_transfer_failed", "decode")
			errorAnswer(t, recvAnswer(t, p, "prefill"), http.StatusInternalServerError, "kv_transfer_failed", "prefill")
			pr.checkClean(t)
			if s := pr.p.kv(t); s.LateEventsTotal != 0 {
				t.Errorf("prefiller late_events_total = %d, want 0", s.LateEventsTotal)
			}
		})
	}
}

func TestSGLangBodiesTheSimRejects(t *testing.T) {
	pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
	tests := []struct {
		name string
		ts   *testServer
		body string
	}{
		{"a decode without bootstrap_host", pr.d, `{"prompt":"x","bootstrap_room":1,"bootstrap_port":8998}`},
		{"a room of 2^63", pr.p, `{"prompt":"x","bootstrap_room":9223372036854775808}`},
		{"one room for two prompts", pr.p, `{"prompt":["x","y"],"bootstrap_room":1}`},
		{"n=2 with a room", pr.p, `{"prompt":"x","n":2,"bootstrap_room":1}`},
		{"rid of the wrong type", pr.p, `{"prompt":"x","rid":7}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := tt.ts.post(t, context.Background(), "/v1/completions", tt.body, nil)
			if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
				t.Errorf("status %d (%s), want 400", resp.StatusCode, b)
			}
		})
	}
	pr.checkClean(t)
}

func TestSGLangNeedsADisaggregationRole(t *testing.T) {
	cfg := sglangConfig("both")
	if _, err := New(cfg, nil); err == nil {
		t.Error("an sglang engine of role both was built")
	}
	cfg.Protocol = "trtllm"
	if _, err := New(cfg, nil); err == nil {
		t.Error("an engine of an unknown protocol was built")
	}
}
