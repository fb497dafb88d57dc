package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
)

// messagesStreamText is streamText of a Messages stream: the text deltas'
// text, and the stop_reason as a finish reason ("length" for max_tokens,
// "stop" for end_turn, "abort" for none). It fails the test unless the
// events come in vLLM's order, message_start first and message_stop last,
// and on an error event.
func messagesStreamText(t *testing.T, events []string) (text, finish string) {
	t.Helper()
	open, started, ended := false, false, false
	for i, ev := range events {
		var e struct {
			Type  string `json:"type"`
			Delta struct {
				Type       string  `json:"type"`
				Text       string  `json:"text"`
				StopReason *string `json:"stop_reason"`
			} `json:"delta"`
		}
		if err := json.Unmarshal([]byte(ev), &e); err != nil {
			t.Fatalf("event %d %q: %v", i, ev, err)
		}
		bad := false
		switch e.Type {
		case "message_start":
			bad = i != 0
		case "content_block_start":
			bad = open || started || ended
			open, started = true, true
		case "content_block_delta":
			bad = !open || e.Delta.Type != "text_delta"
			text += e.Delta.Text
		case "content_block_stop":
			bad = !open
			open = false
		case "message_delta":
			bad = open || ended
			ended = true
			finish = "abort"
			if r := e.Delta.StopReason; r != nil {
				finish = map[string]string{"end_turn": "stop", "max_tokens": "length"}[*r]
			}
		case "message_stop":
			bad = !ended || i != len(events)-1
		default:
			t.Fatalf("stream event %d: %q", i, ev)
		}
		if bad {
			t.Fatalf("%s out of order at %d: %q", e.Type, i, events)
		}
	}
	if !ended || len(events) == 0 || !strings.Contains(events[len(events)-1], `"message_stop"`) {
		t.Fatalf("Messages stream does not end with message_delta, message_stop: %q", events)
	}
	return text, finish
}

func (ts *testServer) anthropic() anthropic.Client {
	return anthropic.NewClient(aoption.WithoutEnvironmentDefaults(), aoption.WithBaseURL(ts.srv.URL+"/"), aoption.WithAPIKey("none"),
		aoption.WithHTTPClient(ts.client), aoption.WithMaxRetries(0))
}

func TestMessagesAPIAnswersWhatTheAnthropicGoSDKParses(t *testing.T) {
	ts := startServer(t, fastConfig())
	client := ts.anthropic()
	want := len(TokenizeChat([]ChatMessage{{"system", "be brief"}, {"user", "hello there"}}, true))
	params := anthropic.MessageNewParams{Model: "sim", MaxTokens: 6, System: []anthropic.TextBlockParam{{Text: "be brief"}},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hello there"))}}
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream %t", stream), func(t *testing.T) {
			rid := fmt.Sprintf("sdk-msg-%t", stream)
			opts := []aoption.RequestOption{aoption.WithHeader("X-Request-Id", rid), aoption.WithJSONSet("ignore_eos", true)}
			var msg anthropic.Message
			if stream {
				s := client.Messages.NewStreaming(context.Background(), params, opts...)
				for s.Next() {
					if err := msg.Accumulate(s.Current()); err != nil {
						t.Fatalf("accumulate: %v", err)
					}
				}
				if err := s.Err(); err != nil {
					t.Fatalf("stream: %v", err)
				}
			} else {
				m, err := client.Messages.New(context.Background(), params, opts...)
				if err != nil {
					t.Fatalf("Messages.New: %v", err)
				}
				msg = *m
				if msg.Role != "assistant" || msg.Type != "message" {
					t.Errorf("whole answer role %q type %q", msg.Role, msg.Type)
				}
			}
			if len(msg.Content) != 1 || msg.Content[0].Type != "text" || msg.Content[0].Text != expectedText(0, rid, 6) {
				t.Errorf("content %+v, want one text block %q", msg.Content, expectedText(0, rid, 6))
			}
			if msg.ID != "chatcmpl-"+rid || msg.Model != "sim" || msg.StopReason != anthropic.StopReasonMaxTokens {
				t.Errorf("answer id %q model %q stop_reason %q, want chatcmpl-%s, sim, max_tokens", msg.ID, msg.Model, msg.StopReason, rid)
			}
			if msg.Usage.InputTokens != int64(want) || msg.Usage.OutputTokens != 6 {
				t.Errorf("usage %+v, want %d input and 6 output tokens", msg.Usage, want)
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}

func TestMessagesStreamSendsVLLMsEventsInOrder(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, tc := range []struct {
		name, rid, extra string
		// tokens is the answer's length, text how many of them have text.
		tokens, text int
		// events is the stream's event types, the deltas counted once.
		events, stop string
	}{
		{"cut by max_tokens", "mo-len", `"ignore_eos":true`, 5, 5,
			"message_start content_block_start content_block_delta content_block_stop message_delta message_stop", `"max_tokens"`},
		// ridWithEOS: token 3 is an EOS, which ends it with no text.
		{"stopped", ridWithEOS("mo-stop", 3), `"min_tokens":0`, 4, 3,
			"message_start content_block_start content_block_delta content_block_stop message_delta message_stop", `"end_turn"`},
		{"an EOS first: no text, no block", ridWithEOS("mo-eos", 0), `"min_tokens":0`, 1, 0,
			"message_start message_delta message_stop", `"end_turn"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), "/v1/messages", `{"model":"sim","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"count"}],`+tc.extra+`}`,
				map[string]string{"X-Request-Id": tc.rid})
			body := string(readAll(t, resp))
			if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("%d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
			}
			var types []string
			deltas := 0
			for _, f := range respFrames(t, body) {
				if f.data["type"] != f.event {
					t.Errorf("frame %s carries type %v", f.event, f.data["type"])
				}
				if f.event == "content_block_delta" {
					if deltas++; deltas > 1 {
						continue
					}
				}
				types = append(types, f.event)
			}
			if got := strings.Join(types, " "); got != tc.events {
				t.Errorf("events %s, want %s", got, tc.events)
			}
			text, _ := messagesStreamText(t, sseEvents(t, []byte(body)))
			if want := expectedText(0, tc.rid, tc.text); text != want {
				t.Errorf("streamed text %q, want %q", text, want)
			}
			prompt := len(TokenizeChat([]ChatMessage{{"user", "count"}}, true))
			start := fmt.Sprintf(`event: message_start
data: {"message":{"content":[],"id":"chatcmpl-%s","model":"sim","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":%d,"output_tokens":0}},"type":"message_start"}`, tc.rid, prompt)
			end := fmt.Sprintf(`data: {"delta":{"stop_reason":%s},"type":"message_delta","usage":{"input_tokens":%d,"output_tokens":%d}}

event: message_stop
data: {"type":"message_stop"}

`, tc.stop, prompt, tc.tokens)
			if !strings.HasPrefix(body, start) || !strings.HasSuffix(body, end) || strings.Contains(body, "[DONE]") || strings.Contains(body, "ping") {
				t.Errorf("stream\n%s\nwant it to start with\n%s\nand end with\n%s", body, start, end)
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}

// chatOf is a Messages conversation as its chat completion's messages.
type chatOf struct {
	name, system, messages, chat string
}

var conversations = []chatOf{
	{"a system string and a user string", `"be brief"`, `[{"role":"user","content":"name a prime"}]`,
		`[{"role":"system","content":"be brief"},{"role":"user","content":"name a prime"}]`},
	{"system blocks without the billing header, text blocks joined", `[{"type":"text","text":"x-anthropic-billing-header: cc=1"},{"type":"text","text":"be "},{"type":"text","text":"brief"}]`,
		`[{"role":"user","content":[{"type":"text","text":"name "},{"type":"image","source":{"type":"url","url":"http://x"}},{"type":"text","text":"a prime"}]}]`,
		`[{"role":"system","content":"be brief"},{"role":"user","content":"name a prime"}]`},
	{"system messages join the system prompt, ctx is the user's", `"be "`,
		`[{"role":"system","content":"brief"},{"role":"ctx","content":"name a prime"}]`,
		`[{"role":"system","content":"be brief"},{"role":"user","content":"name a prime"}]`},
	{"an agent's turn: a tool call, its result as a tool message", `"you read files"`,
		`[{"role":"user","content":"what is in main.go?"},{"role":"assistant","content":[{"type":"thinking","thinking":"read it"},{"type":"tool_use","id":"t1","name":"read","input":{"path":"main.go"}}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"package main"},{"type":"text","text":"func main() {}"}]},{"type":"text","text":"explain it"}]}]`,
		`[{"role":"system","content":"you read files"},{"role":"user","content":"what is in main.go?"},{"role":"assistant","content":null},` +
			`{"role":"tool","content":"package main\nfunc main() {}"},{"role":"user","content":"explain it"}]`},
	{"a user turn of a tool result alone is its tool message", `null`,
		`[{"role":"user","content":"go"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"ls","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.go"}]}]`,
		`[{"role":"user","content":"go"},{"role":"assistant","content":""},{"role":"tool","content":"a.go"}]`},
}

func TestAMessagesRequestIsTheChatOfItsConversation(t *testing.T) {
	// vLLM renders a Messages request as the chat completion it stands
	// for: the same prompt tokens, so the same count, the same greedy
	// answer, and the chat's prefix cache blocks.
	for _, tc := range conversations {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, fastConfig())
			resp := ts.post(t, context.Background(), "/tokenize", `{"messages":`+tc.chat+`}`, nil)
			var tok struct {
				Count int `json:"count"`
			}
			if err := json.Unmarshal(readAll(t, resp), &tok); err != nil || tok.Count == 0 {
				t.Fatalf("tokenize: %v", err)
			}
			conv := `"model":"sim","system":` + tc.system + `,"messages":` + tc.messages
			resp = ts.post(t, context.Background(), "/v1/messages/count_tokens", `{`+conv+`}`, nil)
			if b := string(readAll(t, resp)); b != fmt.Sprintf(`{"input_tokens":%d,"context_management":{"original_input_tokens":%d}}`+"\n", tok.Count, tok.Count) {
				t.Errorf("count_tokens %d %s, want %d tokens", resp.StatusCode, b, tok.Count)
			}
			resp = ts.post(t, context.Background(), "/v1/messages", `{`+conv+`,"max_tokens":6,"temperature":0,"ignore_eos":true}`, nil)
			msg := readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("messages: %d %s", resp.StatusCode, msg)
			}
			resp = ts.post(t, context.Background(), "/v1/chat/completions", `{"messages":`+tc.chat+`,"max_tokens":6,"temperature":0,"ignore_eos":true}`, nil)
			chat := readAll(t, resp)
			if answerText(t, msg) != answerText(t, chat) {
				t.Errorf("messages answered %s, chat %s", msg, chat)
			}
			mp, _ := usageTokens(t, msg)
			cp, _ := usageTokens(t, chat)
			var cached struct {
				Usage usage `json:"usage"`
			}
			_ = json.Unmarshal(chat, &cached)
			// Every full block short of the last token: the Messages request's.
			if hit := (tok.Count - 1) / 16 * 16; mp != tok.Count || cp != tok.Count || cached.Usage.PromptTokensDetails.CachedTokens != hit {
				t.Errorf("prompt tokens: messages %d, chat %d (%+v cached), want %d, the chat hitting the Messages request's blocks", mp, cp, cached.Usage.PromptTokensDetails, tok.Count)
			}
		})
	}
}

// anthropicErrorBody is an answer in Anthropic's error shape.
type anthropicErrorBody struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

func TestMessagesErrorsComeInAnthropicsShape(t *testing.T) {
	ts := startServer(t, func() Config { c := fastConfig(); c.DataParallelSize = 2; return c }())
	hi := `"messages":[{"role":"user","content":"hi"}]`
	for _, tc := range []struct {
		name, path, body string
		hdr              map[string]string
		status           int
		typ              string
	}{
		{"not JSON", "/v1/messages", `{"model":`, nil, 400, "invalid_request_error"},
		{"max_tokens missing", "/v1/messages", `{"model":"sim",` + hi + `}`, nil, 400, "invalid_request_error"},
		{"max_tokens 0", "/v1/messages", `{"model":"sim","max_tokens":0,` + hi + `}`, nil, 400, "invalid_request_error"},
		{"model missing", "/v1/messages", `{"max_tokens":3,` + hi + `}`, nil, 400, "invalid_request_error"},
		{"a role that is none", "/v1/messages", `{"model":"sim","max_tokens":3,"messages":[{"role":"robot","content":"hi"}]}`, nil, 400, "invalid_request_error"},
		{"a block of no known type", "/v1/messages", `{"model":"sim","max_tokens":3,"messages":[{"role":"user","content":[{"type":"video"}]}]}`, nil, 400, "invalid_request_error"},
		{"content null", "/v1/messages", `{"model":"sim","max_tokens":3,"messages":[{"role":"user","content":null}]}`, nil, 400, "invalid_request_error"},
		{"tool_choice tool without a name", "/v1/messages", `{"model":"sim","max_tokens":3,"tool_choice":{"type":"tool"},` + hi + `}`, nil, 400, "invalid_request_error"},
		{"a model not served", "/v1/messages", `{"model":"nope","max_tokens":3,` + hi + `}`, nil, 404, "NotFoundError"},
		{"a rank not served", "/v1/messages", `{"model":"sim","max_tokens":3,` + hi + `}`, map[string]string{HeaderDataParallelRank: "2"}, 400, "invalid_request_error"},
		{"an injected failure", "/v1/messages", `{"model":"sim","max_tokens":3,` + hi + `}`, map[string]string{HeaderFailStatus: "503"}, 503, "service_unavailable"},
		{"a body past the bound", "/v1/messages", `{"model":"sim","system":"` + strings.Repeat("x", maxBodyBytes) + `"}`, nil, 413, "invalid_request_error"},
		{"count_tokens: messages missing", "/v1/messages/count_tokens", `{"model":"sim"}`, nil, 400, "invalid_request_error"},
		{"count_tokens: a model not served", "/v1/messages/count_tokens", `{"model":"nope",` + hi + `}`, nil, 404, "NotFoundError"},
		{"count_tokens: a body past the bound", "/v1/messages/count_tokens", `{"model":"sim","system":"` + strings.Repeat("x", maxBodyBytes) + `"}`, nil, 413, "invalid_request_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), tc.path, tc.body, tc.hdr)
			raw := readAll(t, resp)
			var e anthropicErrorBody
			if err := json.Unmarshal(raw, &e); err != nil || resp.StatusCode != tc.status || e.Type != "error" || e.Error.Type != tc.typ || e.Error.Message == "" {
				t.Errorf("%d %s, want %d with an Anthropic error of type %s", resp.StatusCode, raw, tc.status, tc.typ)
			}
		})
	}
	// The SDK reads them as its errors.
	client := ts.anthropic()
	_, err := client.Messages.New(context.Background(), anthropic.MessageNewParams{Model: "nope", MaxTokens: 3,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hi"))}})
	var ae *anthropic.Error
	if !errors.As(err, &ae) || ae.StatusCode != 404 || !strings.Contains(ae.Error(), "does not exist") {
		t.Errorf("an unknown model through the SDK: %v", err)
	}
	// The OpenAI routes keep the OpenAI shape.
	resp := ts.post(t, context.Background(), "/v1/chat/completions", `{"model":"sim"}`, nil)
	if e := decodeError(t, readAll(t, resp)); e.Code != "missing_messages" {
		t.Errorf("a chat error: %+v", e)
	}
}

func TestAMessagesDecodeRefusedByTheServingLayerFreesItsPrefill(t *testing.T) {
	// As chat's (vLLM #41269): the decoder tells the prefiller, which frees
	// the blocks it held for the decode at once.
	p := startServer(t, fastConfig())
	d := startServer(t, fastConfig())
	conv := `"model":"sim","messages":[{"role":"user","content":"` + strings.Repeat("abcd", 40) + `"}]`
	resp := p.post(t, context.Background(), "/v1/messages", `{`+conv+`,"max_tokens":1,`+prefillKV+`}`, map[string]string{"X-Request-Id": "refused"})
	body := readAll(t, resp)
	var pr struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(body, &pr); err != nil || len(pr.KV) == 0 || p.kv(t).HeldRequests != 1 {
		t.Fatalf("prefill: %d %s, want kv_transfer_params and a hold", resp.StatusCode, body)
	}
	resp = d.post(t, context.Background(), "/v1/messages", strings.Replace(`{`+conv+`,"max_tokens":3,"kv_transfer_params":`+string(pr.KV)+`}`, `"sim"`, `"nope"`, 1),
		map[string]string{"X-Request-Id": "refused"})
	var e anthropicErrorBody
	if raw := readAll(t, resp); resp.StatusCode != http.StatusNotFound || json.Unmarshal(raw, &e) != nil || e.Type != "error" {
		t.Fatalf("decode for another model: %d %s, want a 404 in Anthropic's shape", resp.StatusCode, raw)
	}
	if s := p.waitKV(t, "the refused decode's hold freed", allFree); s.ExpiredTotal != 0 {
		t.Errorf("P /debug/kv = %+v, want the hold freed by the notify", s)
	}
}

func TestAMessagesStreamThatFailsAfterItBeganEndsWithAnErrorEvent(t *testing.T) {
	// A decode that asks for prompt logprobs crashes a vLLM decoder's engine
	// (vLLM #50792): a Messages stream running on it ends with an error
	// event in Anthropic's shape, without message_stop.
	p := startServer(t, fastConfig())
	d := startServer(t, func() Config { c := fastConfig(); c.ITL = 20 * time.Millisecond; return c }())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := d.post(t, ctx, "/v1/messages", `{"model":"sim","max_tokens":1000,"ignore_eos":true,"stream":true,"messages":[{"role":"user","content":"busy"}]}`, nil)
	defer stream.Body.Close()
	sr := bufio.NewReader(stream.Body)
	for {
		line, err := sr.ReadString('\n')
		if err != nil {
			t.Fatalf("stream before its first delta: %v", err)
		}
		if strings.HasPrefix(line, "event: content_block_delta") {
			break
		}
	}
	kv := p.prefill(t, "crash", "hello")
	resp := d.post(t, context.Background(), "/v1/completions", `{"prompt":"hello","max_tokens":1,"prompt_logprobs":1,"kv_transfer_params":`+kv+`}`, map[string]string{"X-Request-Id": "crash"})
	if b := readAll(t, resp); resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("crashing decode: %d %s", resp.StatusCode, b)
	}
	rest, _ := io.ReadAll(sr)
	frames := strings.Split(strings.TrimSpace(string(rest)), "\n\n")
	last := frames[len(frames)-1]
	data, ok := strings.CutPrefix(last, "event: error\ndata: ")
	var e anthropicErrorBody
	if !ok || json.Unmarshal([]byte(data), &e) != nil || e.Type != "error" || e.Error.Type == "" || !strings.Contains(e.Error.Message, "engine") ||
		strings.Contains(string(rest), "message_stop") {
		t.Errorf("the stream's end after the crash: %q, want an error event in Anthropic's shape and no message_stop", rest)
	}
	d.waitKV(t, "D empty", allFree)
}

func TestSGLangServesMessagesAggregatedWhateverItsBootstrapFields(t *testing.T) {
	// SGLang's Messages handler builds its chat request from the Messages
	// members alone: rid and the bootstrap fields never reach the engine,
	// so even a prefiller serves the whole answer, and no room waits.
	ts := startSGLang(t, sglangConfig("prefill"))
	conv := `"model":"sim","max_tokens":5,"ignore_eos":true,"messages":[{"role":"user","content":"hi"}],"rid":"r-1","bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":7`
	prompt := len(TokenizeChat([]ChatMessage{{"user", "hi"}}, true))
	resp := ts.post(t, context.Background(), "/v1/messages", `{`+conv+`}`, nil)
	body := readAll(t, resp)
	var a messagesAnswer
	if err := json.Unmarshal(body, &a); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if !strings.HasPrefix(a.ID, "msg_") || len(a.Content) != 1 || a.Usage.OutputTokens != 5 || a.Usage.InputTokens != prompt ||
		a.Usage.CacheReadInputTokens == nil || *a.StopReason != "max_tokens" || strings.Contains(string(body), "kv_transfer_params") {
		t.Errorf("answer %s, want SGLang's: msg_ id, 5 tokens, cache_read_input_tokens, no kv_transfer_params", body)
	}
	resp = ts.post(t, context.Background(), "/v1/messages", `{`+conv+`,"stream":true}`, nil)
	body = readAll(t, resp)
	events := sseEvents(t, body)
	if text, finish := messagesStreamText(t, events); finish != "length" || text == "" || !strings.Contains(events[0], `"role":"assistant"`) || !strings.Contains(events[0], `"cache_read_input_tokens"`) {
		t.Errorf("stream %s, want SGLang's message_start and 5 tokens", body)
	}
	resp = ts.post(t, context.Background(), "/v1/messages/count_tokens", `{"model":"sim","messages":[{"role":"user","content":"hi"}]}`, nil)
	if b := string(readAll(t, resp)); b != fmt.Sprintf(`{"input_tokens":%d,"context_management":null}`+"\n", prompt) {
		t.Errorf("count_tokens %s", b)
	}
	if s := ts.waitKV(t, "all free", sglangDone); s.RoomsWaiting != 0 || s.RemotePrefillRequestsTotal != 0 {
		t.Errorf("/debug/kv %+v", s)
	}
}
