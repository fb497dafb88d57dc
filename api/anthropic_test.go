package api

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
)

// chatStream is an engine's chat stream with every kind of delta a Messages answer has:
// reasoning, text, a tool call whose arguments come in pieces, the finish, the usage.
const chatStream = `data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"role":"assistant"}}]}

data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}

data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"content":"Hello"}}]}

data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"content":" world"}}]}

data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"read","arguments":"{\"pa"}}]}}]}

data: {"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"th\":\"a\"}"}}]},"finish_reason":"tool_calls"}]}

data: {"id":"chatcmpl-7","model":"m","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":8}}}

data: [DONE]

`

// sseData is the events of a Messages stream: each event's name and its data.
func sseData(t *testing.T, stream []byte) (names []string, data []map[string]any) {
	t.Helper()
	for ev := range strings.SplitSeq(strings.TrimSpace(string(stream)), "\n\n") {
		name, rest, ok := strings.Cut(ev, "\n")
		if !ok || !strings.HasPrefix(name, "event: ") || !strings.HasPrefix(rest, "data: ") {
			t.Fatalf("not an event: %q", ev)
		}
		var d map[string]any
		if err := json.Unmarshal([]byte(strings.TrimPrefix(rest, "data: ")), &d); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		if d["type"] != strings.TrimPrefix(name, "event: ") {
			t.Fatalf("event %q names another type", ev)
		}
		names, data = append(names, d["type"].(string)), append(data, d)
	}
	return names, data
}

func TestAChatStreamBecomesTheMessagesEventsItMeansWhereverItsReadsSplit(t *testing.T) {
	var first []byte
	for cut := 0; cut <= len(chatStream); cut++ {
		tr := &ChatToMessages{Stream: true}
		out := tr.rewrite([]byte(chatStream[:cut]))
		out = append(out, tr.rewrite([]byte(chatStream[cut:]))...)
		out = append(out, tr.flush()...)
		if tr.Err != nil {
			t.Fatalf("cut at %d: %v", cut, tr.Err)
		}
		if first == nil {
			first = out
		} else if !bytes.Equal(out, first) {
			t.Fatalf("cut at %d:\n%s\nwant\n%s", cut, out, first)
		}
	}
	names, data := sseData(t, first)
	want := "message_start ping content_block_start content_block_delta content_block_stop content_block_start content_block_delta content_block_delta content_block_stop " +
		"content_block_start content_block_delta content_block_delta content_block_stop message_delta message_stop"
	if got := strings.Join(names, " "); got != want {
		t.Fatalf("events\n%s\nwant\n%s", got, want)
	}
	// Accumulated as an SDK does: the blocks in index order, the tool's input whole JSON.
	var blocks []map[string]any
	var input string
	for _, d := range data {
		switch d["type"] {
		case "message_start":
			if m := d["message"].(map[string]any); m["id"] != "msg_7" || m["model"] != "m" || m["role"] != "assistant" {
				t.Errorf("message_start %v", m)
			}
		case "content_block_start":
			if int(d["index"].(float64)) != len(blocks) {
				t.Errorf("block %v starts at index %v", d["content_block"], d["index"])
			}
			blocks = append(blocks, d["content_block"].(map[string]any))
		case "content_block_delta":
			b, dl := blocks[int(d["index"].(float64))], d["delta"].(map[string]any)
			switch dl["type"] {
			case "text_delta":
				b["text"] = b["text"].(string) + dl["text"].(string)
			case "thinking_delta":
				b["thinking"] = b["thinking"].(string) + dl["thinking"].(string)
			case "input_json_delta":
				input += dl["partial_json"].(string)
			}
		case "message_delta":
			dl, u := d["delta"].(map[string]any), d["usage"].(map[string]any)
			if dl["stop_reason"] != "tool_use" || u["input_tokens"] != 12.0 || u["output_tokens"] != 5.0 || u["cache_read_input_tokens"] != 8.0 {
				t.Errorf("message_delta %v", d)
			}
		}
	}
	if len(blocks) != 3 || blocks[0]["thinking"] != "think" || blocks[1]["text"] != "Hello world" || blocks[2]["type"] != "tool_use" ||
		blocks[2]["id"] != "call_1" || blocks[2]["name"] != "read" || input != `{"path":"a"}` {
		t.Errorf("blocks %v, tool input %q", blocks, input)
	}
}

func TestAWholeChatAnswerBecomesTheMessageItMeans(t *testing.T) {
	for _, tc := range []struct {
		name, answer, reason string
		stopSeq              any
		content              string
	}{
		{"a stop sequence", `{"id":"chatcmpl-1","model":"m","choices":[{"message":{"content":"hi"},"finish_reason":"stop","matched_stop":"END"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`,
			"stop_sequence", "END", `[{"text":"hi","type":"text"}]`},
		{"its length", `{"id":"chatcmpl-1","model":"m","choices":[{"message":{"content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`,
			"max_tokens", nil, `[{"text":"hi","type":"text"}]`},
		{"an eos", `{"id":"chatcmpl-1","model":"m","choices":[{"message":{"content":"hi"},"finish_reason":"stop","matched_stop":2}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`,
			"end_turn", nil, `[{"text":"hi","type":"text"}]`},
		{"a tool call", `{"id":"chatcmpl-1","model":"m","choices":[{"message":{"content":null,"reasoning_content":"hm","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}`,
			"tool_use", nil, `[{"signature":"","thinking":"hm","type":"thinking"},{"id":"c1","input":{"a":1},"name":"f","type":"tool_use"}]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &ChatToMessages{Stops: []string{"END"}}
			out := tr.rewrite([]byte(tc.answer[:10]))
			out = append(out, tr.rewrite([]byte(tc.answer[10:]))...)
			out = append(out, tr.flush()...)
			var m map[string]json.RawMessage
			if tr.Err != nil || json.Unmarshal(out, &m) != nil {
				t.Fatalf("%s: %v", out, tr.Err)
			}
			seq, _ := json.Marshal(tc.stopSeq)
			if string(m["type"]) != `"message"` || string(m["id"]) != `"msg_1"` || string(m["stop_reason"]) != `"`+tc.reason+`"` ||
				string(m["stop_sequence"]) != string(seq) || string(m["content"]) != tc.content {
				t.Errorf("%s", out)
			}
		})
	}
}

func TestATranslationStopsAtWhatItCannotRead(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stream bool
		in     string
	}{
		{"an error chunk", true, "data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"message\":\"engine died\"}}\n\n"},
		{"a chunk that is not JSON", true, "data: {\"id\":\n\n"},
		{"an event past the bound", true, "data: " + strings.Repeat("x", maxTranslatedEvent+1)},
		{"a stream that ends before any chunk", true, "data: [DONE]\n\n"},
		{"a whole answer that is not one", false, `{"object":"list"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &ChatToMessages{Stream: tc.stream}
			out := tr.rewrite([]byte(tc.in))
			out = append(out, tr.flush()...)
			if tr.Err == nil {
				t.Fatalf("no error; out %q", out)
			}
			if bytes.Contains(out, []byte("message_stop")) {
				t.Errorf("a failed translation ended the stream as if whole: %q", out)
			}
		})
	}
}

func TestMessagesRoutesAnswerErrorsInAnthropicsShape(t *testing.T) {
	for _, tc := range []struct {
		name string
		e    *Error
		want string
	}{
		{"the proxy's own", NewError(KindQueueFull, "busy"), `{"type":"error","error":{"type":"rate_limit_error","message":"busy"}}`},
		{"an engine's OpenAI-shaped refusal", &Error{Kind: KindBackendRefused, Status: 400, raw: []byte(`{"error":{"message":"too long","type":"BadRequestError"}}`)},
			`{"type":"error","error":{"type":"invalid_request_error","message":"too long"}}`},
		{"an engine's Anthropic-shaped refusal, as it came", &Error{Kind: KindBackendRefused, Status: 400, raw: []byte(`{"type":"error","error":{"type":"invalid_request_error","message":"x"}}`)},
			`{"type":"error","error":{"type":"invalid_request_error","message":"x"}}`},
		{"an overloaded pool", NewError(KindNoBackend, "none"), `{"type":"error","error":{"type":"overloaded_error","message":"none"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			WriteError(&anthropicWriter{rec}, tc.e)
			if rec.Body.String() != tc.want || rec.Code != tc.e.Status || rec.Header().Get("Content-Type") != "application/json" {
				t.Errorf("%d %s, want %d %s", rec.Code, rec.Body.String(), tc.e.Status, tc.want)
			}
		})
	}
}
