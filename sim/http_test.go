package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// do is post without failing on a transport error, for faults that cut the connection.
func (ts *testServer) do(ctx context.Context, path, body string, hdr map[string]string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.srv.URL+path, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	return ts.client.Do(req)
}

// prefill runs a prefill of prompt for rid on ts and returns P's kv_transfer_params, raw.
func (ts *testServer) prefill(t *testing.T, rid, prompt string) string {
	t.Helper()
	resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":"`+prompt+`","max_tokens":1,`+prefillKV+`}`, map[string]string{"X-Request-Id": rid})
	body := readAll(t, resp)
	var pr struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &pr) != nil || string(pr.KV) == "null" {
		t.Fatalf("prefill %s: status %d, body %s", rid, resp.StatusCode, body)
	}
	return string(pr.KV)
}

type openAIError struct {
	Error apiError `json:"error"`
}

func decodeError(t *testing.T, body []byte) apiError {
	t.Helper()
	var e openAIError
	if err := json.Unmarshal(body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
		t.Fatalf("body %s is not an OpenAI error (%v)", body, err)
	}
	return e.Error
}

// ridWithEOS finds a request id whose token source ends (EOS) exactly at
// token index at, and not at index at+1.
func ridWithEOS(prefix string, at int) string {
	for i := 0; ; i++ {
		rid := fmt.Sprintf("%s-%d", prefix, i)
		h := ridHash(0, rid)
		ok := tokenIsEOS(h, at) && !tokenIsEOS(h, at+1)
		for j := range at {
			ok = ok && !tokenIsEOS(h, j)
		}
		if ok {
			return rid
		}
	}
}

func TestClientDisconnectMidStreamAbortsAndFreesBlocks(t *testing.T) {
	prompt := strings.Repeat("x", 200) // 50 tokens: 4 blocks
	tests := []struct {
		name string
		pd   bool
		path string
	}{
		{name: "aggregated stream", path: "/v1/completions"},
		{name: "decode stream after the pull", pd: true, path: "/v1/completions"},
		{name: "responses decode stream after the pull", pd: true, path: "/v1/responses"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startServer(t, fastConfig())
			d := startServer(t, fastConfig())
			rid := "gone-" + strings.ReplaceAll(tt.name, " ", "-")
			kv := ""
			if tt.pd {
				kv = `,"kv_transfer_params":` + p.prefill(t, rid, prompt)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := `{"prompt":"` + prompt + `","max_tokens":100000,"ignore_eos":true,"stream":true` + kv + `}`
			if tt.path == "/v1/responses" {
				// "x"*200 again, so that the 4 pulled blocks are this prompt's.
				body = `{"input":[{"role":"user","content":"` + prompt[:190] + `"}],"max_output_tokens":100000,"ignore_eos":true,"stream":true` + kv + `}`
			}
			resp := d.post(t, ctx, tt.path, body, map[string]string{"X-Request-Id": rid})
			br := bufio.NewReader(resp.Body)
			for {
				line, err := br.ReadString('\n')
				if err != nil {
					t.Fatalf("stream ended before a token: %v", err)
				}
				if strings.Contains(line, `" tok`) {
					break
				}
			}
			if s := d.kv(t); s.BlocksInUse != 4 || s.RunningRequests != 1 {
				t.Errorf("while streaming D /debug/kv = %+v, want 4 blocks in use by 1 request", s)
			}
			cancel()
			resp.Body.Close()
			s := d.waitKV(t, "decoder frees after the client left", allFree)
			if s.AbortedTotal != 1 || s.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("D /debug/kv = %+v, want 1 abort and no double free", s)
			}
			p.waitKV(t, "prefiller holds nothing", allFree)
		})
	}
}

func TestDecodeOfAHoldNoLongerThereFailsWithServerErrorNot200(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			p := startServer(t, fastConfig())
			d := startServer(t, fastConfig())
			rid := fmt.Sprintf("stale-%v", stream)
			kv := p.prefill(t, rid, "hello")
			abort := p.post(t, context.Background(), "/abort_request", `{"rid":"`+rid+`"}`, nil)
			if b := readAll(t, abort); abort.StatusCode != http.StatusOK {
				t.Fatalf("abort_request: %d %s", abort.StatusCode, b)
			}
			p.waitKV(t, "explicit abort frees the hold", allFree)

			resp := d.post(t, context.Background(), "/v1/completions",
				fmt.Sprintf(`{"prompt":"hello","max_tokens":4,"stream":%v,"kv_transfer_params":%s}`, stream, kv), map[string]string{"X-Request-Id": rid})
			body := readAll(t, resp)
			if resp.StatusCode != http.StatusInternalServerError {
				t.Fatalf("decode of a freed hold: status %d, body %s; want 500", resp.StatusCode, body)
			}
			if e := decodeError(t, body); e.Code != "kv_transfer_failed" {
				t.Errorf("error code %q, want kv_transfer_failed", e.Code)
			}
			d.waitKV(t, "decoder frees its blocks", allFree)
			if s := p.kv(t); s.AbortedTotal != 1 || s.LateEventsTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("P /debug/kv = %+v, want 1 abort and nothing late", s)
			}
		})
	}
}

func TestClientGoneAfterPrefillFinishedKeepsTheHoldUntilAbortRequest(t *testing.T) {
	// Race R1 made reproducible: the stall delays P's answer after the
	// prefill finished, the client leaves, the abort finds a finished
	// request and P keeps the blocks for a decoder.
	p := startServer(t, fastConfig())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		resp, err := p.do(ctx, "/v1/completions", `{"prompt":"hello","max_tokens":1,`+prefillKV+`}`,
			map[string]string{"X-Request-Id": "r1-stalled", HeaderStall: "1h"})
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	p.waitKV(t, "prefill held", func(s KVStats) bool { return s.HeldRequests == 1 })
	cancel()
	if err := testutil.Recv(t, testutil.Timeout, done, "the client's end"); err == nil {
		t.Fatal("client got an answer through a 1h stall")
	}
	s := p.waitKV(t, "abort seen as late", func(s KVStats) bool { return s.LateEventsTotal == 1 })
	if s.HeldRequests != 1 || s.AbortedTotal != 0 {
		t.Errorf("after the client left P /debug/kv = %+v, want the hold kept", s)
	}
	resp := p.post(t, context.Background(), "/abort_request", `{"rid":"r1-stalled"}`, nil)
	readAll(t, resp)
	s = p.waitKV(t, "abort_request frees the hold", allFree)
	if s.AbortedTotal != 1 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("P /debug/kv = %+v, want 1 abort", s)
	}
}

func TestFaultHeaders(t *testing.T) {
	const streamBody = `{"prompt":"hello","max_tokens":6,"ignore_eos":true,"stream":true}`
	const wholeBody = `{"prompt":"hello","max_tokens":6,"ignore_eos":true}`
	tests := []struct {
		name  string
		body  string
		hdr   map[string]string
		check func(t *testing.T, resp *http.Response, err error)
	}{
		{
			name: "fail status answers at once with an OpenAI error and Retry-After",
			body: wholeBody, hdr: map[string]string{HeaderFailStatus: "503"},
			check: func(t *testing.T, resp *http.Response, err error) {
				body := readAll(t, resp)
				if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
					t.Errorf("status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
				}
				if e := decodeError(t, body); e.Code != "injected_fault" {
					t.Errorf("error %+v", e)
				}
			},
		},
		{
			name: "close after 2 events cuts the stream before [DONE]",
			body: streamBody, hdr: map[string]string{HeaderCloseAfter: "2"},
			check: func(t *testing.T, resp *http.Response, err error) {
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, rerr := io.ReadAll(resp.Body)
				if rerr == nil || strings.Count(string(b), "data: ") != 2 {
					t.Errorf("read %q, %v; want 2 events then a broken connection", b, rerr)
				}
			},
		},
		{
			name: "close after 0 cuts before any byte",
			body: streamBody, hdr: map[string]string{HeaderCloseAfter: "0"},
			check: func(t *testing.T, resp *http.Response, err error) {
				if err == nil {
					resp.Body.Close()
					t.Errorf("got status %d, want a transport error", resp.StatusCode)
				}
			},
		},
		{
			name: "close after 10 bytes cuts a non-streaming body",
			body: wholeBody, hdr: map[string]string{HeaderCloseAfter: "10"},
			check: func(t *testing.T, resp *http.Response, err error) {
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, rerr := io.ReadAll(resp.Body)
				if rerr == nil || len(b) != 10 {
					t.Errorf("read %q, %v; want 10 bytes then unexpected EOF", b, rerr)
				}
			},
		},
		{
			name: "stall and slow write still deliver the whole stream",
			body: streamBody, hdr: map[string]string{HeaderStall: "1ms", HeaderSlowWrite: "1ms"},
			check: func(t *testing.T, resp *http.Response, err error) {
				if err != nil {
					t.Fatal(err)
				}
				text, finish := streamText(t, sseEvents(t, readAll(t, resp)))
				if strings.Count(text, " tok") != 6 || finish != "length" {
					t.Errorf("text %q finish %q", text, finish)
				}
			},
		},
		{
			name: "malformed fault header is a 400",
			body: wholeBody, hdr: map[string]string{HeaderStall: "soon"},
			check: func(t *testing.T, resp *http.Response, err error) {
				body := readAll(t, resp)
				if resp.StatusCode != 400 || decodeError(t, body).Type != "invalid_request_error" {
					t.Errorf("status %d body %s", resp.StatusCode, body)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := startServer(t, fastConfig())
			resp, err := ts.do(context.Background(), "/v1/completions", tt.body, tt.hdr)
			tt.check(t, resp, err)
			if s := ts.waitKV(t, "all free after the fault", allFree); s.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("/debug/kv = %+v", s)
			}
		})
	}
}

// nothingHeldKV is a decode's kv_transfer_params that name no block: a
// decoder rejecting it has no prefiller to notify.
const nothingHeldKV = `"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":1,"remote_block_ids":[]}`

func TestBadInputIsA400InTheOpenAIErrorShape(t *testing.T) {
	huge := strings.Repeat("y", 64*16*4+4) // one token more than the pool holds
	tests := []struct {
		name, path, body, code string
	}{
		{"body not JSON", "/v1/completions", `not json`, "invalid_json"},
		{"prompt missing", "/v1/completions", `{"max_tokens":3}`, "missing_prompt"},
		{"max_tokens zero", "/v1/completions", `{"prompt":"x","max_tokens":0}`, "invalid_max_tokens"},
		{"max_tokens not a number", "/v1/completions", `{"prompt":"x","max_tokens":"ten"}`, "invalid_json"},
		{"n zero", "/v1/completions", `{"prompt":"x","n":0}`, "invalid_n"},
		{"best_of below n", "/v1/completions", `{"prompt":"x","n":3,"best_of":2}`, "invalid_best_of"},
		{"several choices of a decode with kv_transfer_params", "/v1/completions", `{"prompt":"x","n":2,` + nothingHeldKV + `}`, "invalid_n"},
		{"best_of on a decode with kv_transfer_params", "/v1/completions", `{"prompt":"x","best_of":2,` + nothingHeldKV + `}`, "invalid_n"},
		{"batched prompts on a decode with kv_transfer_params", "/v1/completions", `{"prompt":["a","b"],` + nothingHeldKV + `}`, "invalid_prompt"},
		{"chat n on a decode with kv_transfer_params", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"n":2,` + nothingHeldKV + `}`, "invalid_n"},
		{"min_tokens above max_tokens", "/v1/completions", `{"prompt":"x","max_tokens":2,"min_tokens":5}`, "invalid_min_tokens"},
		{"prompt larger than the whole pool", "/v1/completions", `{"prompt":"` + huge + `"}`, "prompt_too_long"},
		{"decode without a prefiller address", "/v1/completions", `{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}`, "invalid_kv_transfer_params"},
		{"chat without messages", "/v1/chat/completions", `{"messages":[]}`, "missing_messages"},
		{"chat content of the wrong type", "/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`, "invalid_messages"},
	}
	ts := startServer(t, fastConfig())
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), tt.path, tt.body, nil)
			body := readAll(t, resp)
			if resp.StatusCode != http.StatusBadRequest {
				t.Fatalf("status %d, body %s", resp.StatusCode, body)
			}
			if e := decodeError(t, body); e.Code != tt.code || e.Type != "invalid_request_error" {
				t.Errorf("error %+v, want code %s", e, tt.code)
			}
		})
	}
	if s := ts.kv(t); s.RequestsTotal != 0 {
		t.Errorf("rejected requests reached the scheduler: %+v", s)
	}
}

func TestEarlyStopIsDeterministic(t *testing.T) {
	ts := startServer(t, fastConfig())
	stopAt2 := ridWithEOS("stop", 2)
	tests := []struct {
		name, rid, body string
		want            []string
	}{
		{
			name: "without ignore_eos a request stops on its EOS token", rid: stopAt2,
			body: `{"prompt":"hi","max_tokens":10}`,
			want: []string{`"finish_reason":"stop"`, `"completion_tokens":3`, `"text":"` + expectedText(0, stopAt2, 2) + `"`},
		},
		{
			name: "min_tokens suppresses an EOS before it", rid: stopAt2,
			body: `{"prompt":"hi","max_tokens":4,"min_tokens":3}`,
			want: []string{`"finish_reason":"length"`, `"completion_tokens":4`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), "/v1/completions", tt.body, map[string]string{"X-Request-Id": tt.rid})
			body := string(readAll(t, resp))
			for _, w := range tt.want {
				if !strings.Contains(body, w) {
					t.Errorf("body %s lacks %s", body, w)
				}
			}
			ts.waitKV(t, "all free", allFree)
		})
	}
}

func TestInfoEndpoints(t *testing.T) {
	ts := startServer(t, fastConfig())
	tests := []struct {
		path string
		want []string
	}{
		{"/health", nil},
		{"/v1/models", []string{`"object":"list"`, `"id":"sim"`, `"object":"model"`}},
		{"/metrics", []string{`vllm:num_requests_running{model_name="sim"} 0`, `vllm:num_requests_waiting{model_name="sim"} 0`, `vllm:kv_cache_usage_perc{model_name="sim"} 0`}},
		{"/debug/kv", []string{`"blocks_total":64`, `"blocks_free":64`, `"double_free_attempts_total":0`, `"late_events_total":0`, `"held_requests":0`}},
	}
	for _, tt := range tests {
		t.Run("GET "+tt.path, func(t *testing.T) {
			body := string(ts.get(t, tt.path))
			for _, w := range tt.want {
				if !strings.Contains(body, w) {
					t.Errorf("%s lacks %s:\n%s", tt.path, w, body)
				}
			}
		})
	}
}
