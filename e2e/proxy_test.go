package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

type completion struct {
	ID      string `json:"id"`
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

func TestCompletionGoesThroughPrefillerAndDecoder(t *testing.T) {
	s := startStack(t, fastSims)
	p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	pBefore, dBefore := kv(t, p).RequestsTotal, kv(t, d).RequestsTotal

	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"hello there","max_tokens":20,"ignore_eos":true}`)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("no X-Request-Id in the answer")
	}
	var c completion
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		t.Fatal(err)
	}
	if len(c.Choices) != 1 || strings.TrimSpace(c.Choices[0].Text) == "" {
		t.Fatalf("no text in %+v", c)
	}
	if c.Usage == nil || c.Usage.CompletionTokens != 20 {
		t.Fatalf("usage %+v, want 20 completion tokens", c.Usage)
	}
	if got := kv(t, p).RequestsTotal - pBefore; got != 1 {
		t.Errorf("prefiller served %d requests, want 1", got)
	}
	if got := kv(t, d).RequestsTotal - dBefore; got != 1 {
		t.Errorf("decoder served %d requests, want 1", got)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "decoded"}); got != 1 {
		t.Errorf("kv releases (decoded) = %v, want 1: the prefiller's params went to the decoder", got)
	}
	s.assertQuiet(time.Second)
}

func TestStreamReachesClientChunkByChunk(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		c.Sims[1].ITL = 100 * time.Millisecond
	})
	d := s.m.SimURLs("decode")[0]
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"count","max_tokens":6,"ignore_eos":true,"stream":true}`)
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("content type %q", ct)
	}
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(first, "data: ") {
		t.Fatalf("first line %q, %v", first, err)
	}
	// The first token is here while the decoder is still generating the rest: nothing
	// between the decoder and the client waited for more.
	if st := kv(t, d); st.RunningRequests != 1 {
		t.Fatalf("decoder running %d requests when the first chunk arrived; want 1 (still streaming)", st.RunningRequests)
	}
	rest := sseEvents(t, br)
	events := append([]string{strings.TrimPrefix(strings.TrimSpace(first), "data: ")}, rest...)
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream does not end with [DONE]: %q", events[len(events)-1])
	}
	text := ""
	for _, e := range events[:len(events)-1] {
		var c completion
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("chunk %q: %v", e, err)
		}
		for _, ch := range c.Choices {
			text += ch.Text
		}
	}
	if n := len(strings.Fields(text)); n != 6 {
		t.Fatalf("streamed %d tokens (%q), want 6", n, text)
	}
	s.assertQuiet(time.Second)
}

func TestChatStreamCarriesDeltaContentAndUsage(t *testing.T) {
	s := startStack(t, fastSims)
	resp := post(t, context.Background(), s.url+"/v1/chat/completions",
		`{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`)
	defer resp.Body.Close()
	events := sseEvents(t, resp.Body)
	if len(events) < 3 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q", events)
	}
	var content string
	var usage *completion
	for _, e := range events[:len(events)-1] {
		var c completion
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("chunk %q: %v", e, err)
		}
		for _, ch := range c.Choices {
			content += ch.Delta.Content
		}
		if c.Usage != nil {
			cc := c
			usage = &cc
		}
	}
	if len(strings.Fields(content)) != 5 {
		t.Fatalf("delta content %q, want 5 tokens", content)
	}
	if usage == nil || usage.Usage.CompletionTokens != 5 {
		t.Fatalf("no usage chunk with 5 completion tokens: %+v", usage)
	}
	s.assertQuiet(time.Second)
}

func TestModelsHealthReadyMetrics(t *testing.T) {
	s := startStack(t, fastSims)
	// The model label names a model once the engines have listed theirs (their first health
	// check); before, it is "other".
	waitForModels(t, s)
	get := func(path string) (int, string) {
		resp, err := http.Get(s.url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("/v1/models")
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if code != 200 || json.Unmarshal([]byte(body), &list) != nil || len(list.Data) != 1 || list.Data[0].ID != "sim" {
		t.Fatalf("/v1/models: %d %s", code, body)
	}
	if code, _ := get("/health"); code != 200 {
		t.Errorf("/health %d", code)
	}
	if code, _ := get("/ready"); code != 200 {
		t.Errorf("/ready %d", code)
	}
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"x","max_tokens":2}`)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	// The request is counted as its handler ends, which may be just after the client has the
	// whole answer.
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, metrics := get("/metrics")
		for _, name := range []string{
			`pdproxy_requests_total{code="200",model="sim",route="/v1/completions"} 1`,
			"pdproxy_request_duration_seconds_bucket",
			"pdproxy_time_to_first_token_seconds_bucket",
			"pdproxy_inflight_requests",
		} {
			if !strings.Contains(metrics, name) {
				return false, "/metrics lacks " + name
			}
		}
		return true, ""
	})
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		code, body := get("/debug/requests")
		return code == 200 && strings.TrimSpace(body) == "[]", fmt.Sprintf("/debug/requests when idle: %d %s", code, body)
	})
}

func TestOpenAISDKAgainstTheProxy(t *testing.T) {
	s := startStack(t, fastSims)
	// ignore_eos (a vLLM extension, passed through untouched): without it the simulator may end
	// an answer on an EOS token before any text, by design, and the checks below want text.
	client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
		option.WithJSONSet("ignore_eos", true))
	ctx := context.Background()

	t.Run("chat", func(t *testing.T) {
		resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:     "sim",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("say something")},
			MaxTokens: openai.Int(7),
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
			t.Fatalf("chat answer %+v", resp)
		}
	})
	t.Run("chat streaming", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model:     "sim",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream please")},
			MaxTokens: openai.Int(8),
		})
		acc := openai.ChatCompletionAccumulator{}
		chunks := 0
		for stream.Next() {
			acc.AddChunk(stream.Current())
			chunks++
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if chunks < 2 || len(acc.Choices) != 1 || acc.Choices[0].Message.Content == "" {
			t.Fatalf("%d chunks, accumulated %+v", chunks, acc.Choices)
		}
	})
	t.Run("completion", func(t *testing.T) {
		resp, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model:     "sim",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
			MaxTokens: openai.Int(6),
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Text == "" {
			t.Fatalf("completion %+v", resp)
		}
	})
	t.Run("completion streaming", func(t *testing.T) {
		stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
			Model:     "sim",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("stream a completion")},
			MaxTokens: openai.Int(6),
		})
		text := ""
		for stream.Next() {
			for _, c := range stream.Current().Choices {
				text += c.Text
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if text == "" {
			t.Fatal("no streamed text")
		}
	})
	t.Run("error comes back as an API error", func(t *testing.T) {
		_, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "sim", Messages: []openai.ChatCompletionMessageParamUnion{}})
		var apiErr *openai.Error
		if !asOpenAIError(err, &apiErr) || apiErr.StatusCode != 400 {
			t.Fatalf("want a 400 API error, got %v", err)
		}
	})
	t.Run("stream cancelled through its context frees the KV", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stream := client.Chat.Completions.NewStreaming(cctx, openai.ChatCompletionNewParams{
			Model:     "sim",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("a long answer")},
			MaxTokens: openai.Int(100000),
		})
		for i := 0; i < 3 && stream.Next(); i++ {
		}
		cancel()
		stream.Close()
		testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
			st := kv(t, s.m.SimURLs("decode")[0])
			return st.AbortedTotal >= 1, "decoder saw no abort"
		})
	})
	s.assertQuiet(time.Second)
}

func TestClientLeavingMidStreamAbortsTheDecodeAndFreesItsKV(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		c.Sims[1].ITL = 5 * time.Millisecond
	})
	d := s.m.SimURLs("decode")[0]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp := post(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+strings.Repeat("long prompt ", 200)+`","max_tokens":100000,"ignore_eos":true,"stream":true}`)
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ {
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	if st := kv(t, d); st.BlocksFree == st.BlocksTotal {
		t.Fatalf("decoder holds no blocks mid-stream: %+v", st)
	}
	cancel()
	resp.Body.Close()
	gone := time.Now()
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, d)
		return st.AbortedTotal == 1 && st.BlocksFree == st.BlocksTotal && st.RunningRequests == 0, "decoder: " + jsonString(st)
	})
	t.Logf("decoder aborted and freed every block %s after the client left", time.Since(gone).Round(time.Millisecond))
	if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"}); got != 1 {
		t.Errorf("pdproxy_aborts_total{stage=decoding} = %v, want 1", got)
	}
	s.assertQuiet(time.Second)
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func asOpenAIError(err error, target **openai.Error) bool {
	if err == nil {
		return false
	}
	e, ok := err.(*openai.Error)
	if ok {
		*target = e
	}
	return ok
}
