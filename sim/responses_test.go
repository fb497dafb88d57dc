package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

func (ts *testServer) sdk() openai.Client {
	return openai.NewClient(option.WithBaseURL(ts.srv.URL+"/v1/"), option.WithAPIKey("none"),
		option.WithHTTPClient(ts.client), option.WithMaxRetries(0))
}

func TestResponsesAPIAnswersWhatTheOpenAIGoSDKParses(t *testing.T) {
	ts := startServer(t, fastConfig())
	client := ts.sdk()
	// The chat template of a system and a user message: what the answer counts.
	want := len(TokenizeChat([]ChatMessage{{"system", "be brief"}, {"user", "hello there"}}, true))
	items := responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
		responses.ResponseInputItemParamOfMessage("hello there", responses.EasyInputMessageRoleUser),
	}}
	for _, tc := range []struct {
		name   string
		input  responses.ResponseNewParamsInputUnion
		stream bool
	}{
		{"a string input", responses.ResponseNewParamsInputUnion{OfString: openai.String("hello there")}, false},
		{"message items", items, false},
		{"message items streamed", items, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rid := "sdk-" + strings.ReplaceAll(tc.name, " ", "-")
			params := responses.ResponseNewParams{Model: "sim", Input: tc.input, Instructions: openai.String("be brief"), MaxOutputTokens: openai.Int(6)}
			opts := []option.RequestOption{option.WithHeader("X-Request-Id", rid), option.WithJSONSet("ignore_eos", true)}
			var r *responses.Response
			if tc.stream {
				stream := client.Responses.NewStreaming(context.Background(), params, opts...)
				var deltas strings.Builder
				for stream.Next() {
					ev := stream.Current()
					if ev.Type == "response.output_text.delta" {
						deltas.WriteString(ev.Delta)
					}
					if ev.Type == "response.incomplete" || ev.Type == "response.completed" {
						done := ev.Response
						r = &done
					}
				}
				if err := stream.Err(); err != nil {
					t.Fatalf("stream: %v", err)
				}
				if r == nil || deltas.String() != r.OutputText() {
					t.Fatalf("stream deltas %q, final response %+v", deltas.String(), r)
				}
			} else {
				var err error
				if r, err = client.Responses.New(context.Background(), params, opts...); err != nil {
					t.Fatalf("Responses.New: %v", err)
				}
			}
			if got := r.OutputText(); got != expectedText(0, rid, 6) {
				t.Errorf("output text %q, want %q", got, expectedText(0, rid, 6))
			}
			if r.ID != "resp_"+rid || r.Status != responses.ResponseStatusIncomplete || r.IncompleteDetails.Reason != "max_output_tokens" || r.Model != "sim" {
				t.Errorf("response %s %s %+v %s, want resp_%s incomplete for max_output_tokens", r.ID, r.Status, r.IncompleteDetails, r.Model, rid)
			}
			if u := r.Usage; u.InputTokens != int64(want) || u.OutputTokens != 6 || u.TotalTokens != int64(want)+6 {
				t.Errorf("usage %+v, want %d input and 6 output tokens", u, want)
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}

// respFrame is one frame of a Responses API stream.
type respFrame struct {
	event string
	data  map[string]any
}

func respFrames(t *testing.T, body string) []respFrame {
	t.Helper()
	var out []respFrame
	for _, f := range strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n") {
		ev, data, ok := strings.Cut(f, "\n")
		typ, ok1 := strings.CutPrefix(ev, "event: ")
		payload, ok2 := strings.CutPrefix(data, "data: ")
		if !ok || !ok1 || !ok2 {
			t.Fatalf("frame %q is not event: then data:", f)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(payload), &m); err != nil {
			t.Fatalf("frame %q: %v", f, err)
		}
		out = append(out, respFrame{typ, m})
	}
	return out
}

func TestResponsesStreamSendsItsEventsInOrderAndNoDone(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, tc := range []struct {
		name, rid, extra, last string
		tokens                 int
	}{
		{"cut by max_output_tokens", "order-len", `"ignore_eos":true`, "response.incomplete", 5},
		// ridWithEOS: token 3 is an EOS, which ends it with no text.
		{"stopped", ridWithEOS("order-stop", 3), `"min_tokens":0`, "response.completed", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), "/v1/responses", `{"input":"count","max_output_tokens":5,"stream":true,`+tc.extra+`}`,
				map[string]string{"X-Request-Id": tc.rid})
			body := string(readAll(t, resp))
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("status %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
			}
			if strings.Contains(body, "[DONE]") {
				t.Errorf("the stream sends [DONE]: %s", body)
			}
			frames := respFrames(t, body)
			var types []string
			for i, f := range frames {
				if f.data["type"] != f.event || f.data["sequence_number"] != float64(i) {
					t.Errorf("frame %d: event %s, data type %v, sequence_number %v", i, f.event, f.data["type"], f.data["sequence_number"])
				}
				if f.event != "response.output_text.delta" || len(types) == 0 || types[len(types)-1] != f.event {
					types = append(types, f.event)
				}
			}
			want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
				"response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done", tc.last}
			if fmt.Sprint(types) != fmt.Sprint(want) {
				t.Errorf("events %v, want %v", types, want)
			}
			deltas := 0
			for _, f := range frames {
				if f.event == "response.output_text.delta" {
					deltas++
					if f.data["item_id"] != "msg_"+tc.rid || f.data["output_index"] != float64(0) || f.data["content_index"] != float64(0) {
						t.Errorf("delta %v", f.data)
					}
				}
			}
			if text, _ := streamText(t, sseEvents(t, []byte(body))); deltas != tc.tokens || text != expectedText(0, tc.rid, tc.tokens) {
				t.Errorf("%d deltas %q, want %d: %q", deltas, text, tc.tokens, expectedText(0, tc.rid, tc.tokens))
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}

func TestStoredResponseIsReadBackAndContinuedByPreviousResponseID(t *testing.T) {
	ts := startServer(t, fastConfig())
	prompt := strings.Repeat("tell me more about the sea ", 10)
	post := func(rid, body string) (int, []byte) {
		resp := ts.post(t, context.Background(), "/v1/responses", body, map[string]string{"X-Request-Id": rid})
		return resp.StatusCode, readAll(t, resp)
	}
	status, first := post("turn-1", `{"input":"`+prompt+`","max_output_tokens":4,"ignore_eos":true}`)
	if status != http.StatusOK {
		t.Fatalf("first turn: %d %s", status, first)
	}
	got := ts.get(t, "/v1/responses/resp_turn-1")
	if answerText(t, got) != answerText(t, first) || !strings.Contains(string(got), `"id":"resp_turn-1"`) {
		t.Errorf("GET answered %s, want the first turn %s", got, first)
	}
	status, second := post("turn-2", `{"input":"and the sky?","previous_response_id":"resp_turn-1","max_output_tokens":4,"ignore_eos":true}`)
	if status != http.StatusOK {
		t.Fatalf("second turn: %d %s", status, second)
	}
	// The conversation: the first input, its answer, then the new input.
	conv := TokenizeChat([]ChatMessage{{"user", prompt}, {"assistant", expectedText(0, "turn-1", 4)}, {"user", "and the sky?"}}, true)
	var u struct {
		Usage struct {
			InputTokens        int `json:"input_tokens"`
			InputTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
		PreviousResponseID string `json:"previous_response_id"`
	}
	if err := json.Unmarshal(second, &u); err != nil {
		t.Fatal(err)
	}
	firstPrompt := len(TokenizeChat([]ChatMessage{{"user", prompt}}, true))
	if u.Usage.InputTokens != len(conv) || u.Usage.InputTokensDetails.CachedTokens < firstPrompt/16*16-16 || u.PreviousResponseID != "resp_turn-1" {
		t.Errorf("second turn %s: want %d input tokens, the first turn's prompt (%d tokens) cached", second, len(conv), firstPrompt)
	}

	for _, tc := range []struct{ name, method, path, body string }{
		{"previous_response_id unknown", http.MethodPost, "/v1/responses", `{"input":"x","previous_response_id":"resp_nobody"}`},
		{"GET of an unknown id", http.MethodGet, "/v1/responses/resp_nobody", ""},
		{"GET of a response sent with store false", http.MethodGet, "/v1/responses/resp_unstored", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if status, b := post("unstored", `{"input":"x","store":false,"max_output_tokens":1}`); status != http.StatusOK {
				t.Fatalf("store false: %d %s", status, b)
			}
			req, _ := http.NewRequest(tc.method, ts.srv.URL+tc.path, strings.NewReader(tc.body))
			resp, err := ts.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b := readAll(t, resp)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if resp.StatusCode != http.StatusNotFound || json.Unmarshal(b, &e) != nil || e.Error.Code != 404 || !strings.Contains(e.Error.Message, "not found") {
				t.Errorf("status %d %s, want vLLM's 404", resp.StatusCode, b)
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}

func TestResponsesBodiesTheSimRefuses(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, tc := range []struct{ name, body, code string }{
		{"no input", `{"model":"sim"}`, "missing_input"},
		{"an input item of another type", `{"input":[{"type":"function_call","name":"f"}]}`, "invalid_input"},
		{"an item without a role", `{"input":[{"content":"hi"}]}`, "invalid_input"},
		{"background", `{"input":"hi","background":true}`, "unsupported_background"},
		{"max_output_tokens 0", `{"input":"hi","max_output_tokens":0}`, "invalid_max_tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), "/v1/responses", tc.body, nil)
			b := readAll(t, resp)
			if e := decodeError(t, b); resp.StatusCode != http.StatusBadRequest || e.Code != tc.code {
				t.Errorf("status %d %s, want 400 %s", resp.StatusCode, b, tc.code)
			}
		})
	}
}
