package e2e

// End-to-end tests of Anthropic's Messages API (POST /v1/messages) under P/D, driven by the
// official Anthropic Go SDK: natively on the vLLM protocols (NIXL, Mooncake), whose handler
// takes kv_transfer_params and which the simulated engines serve as vLLM does, and as a
// translated chat completion on SGLang, whose handler drops the bootstrap fields.

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
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/faultengine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// anthropicClient is the SDK pointed at the stack, retrying nothing, with the sims' greedy
// full-length answers (the SDK has no field for temperature: it goes as an extra member).
func anthropicClient(s *stack, opts ...aoption.RequestOption) anthropic.Client {
	base := []aoption.RequestOption{aoption.WithoutEnvironmentDefaults(), aoption.WithBaseURL(s.url + "/"), aoption.WithAPIKey("unused"),
		aoption.WithMaxRetries(0), aoption.WithJSONSet("ignore_eos", true),
		aoption.WithJSONSet("temperature", 0)} // greedy: one prompt, one answer
	return anthropic.NewClient(append(base, opts...)...)
}

// agentTurn is a conversation as a coding agent sends it: a system prompt, a tool, an
// earlier tool call and its result.
func agentTurn(maxTokens int64) anthropic.MessageNewParams {
	return anthropic.MessageNewParams{
		Model:     "sim",
		MaxTokens: maxTokens,
		System:    []anthropic.TextBlockParam{{Text: "You are a careful coding agent."}},
		Tools: []anthropic.ToolUnionParam{{OfTool: &anthropic.ToolParam{Name: "read_file",
			InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"path": map[string]string{"type": "string"}}}}}},
		Messages: []anthropic.MessageParam{
			anthropic.NewUserMessage(anthropic.NewTextBlock("What does main.go do?")),
			anthropic.NewAssistantMessage(anthropic.NewToolUseBlock("toolu_1", map[string]string{"path": "main.go"}, "read_file")),
			anthropic.NewUserMessage(anthropic.NewToolResultBlock("toolu_1", "package main\nfunc main() {}", false)),
		},
	}
}

// messagesProtocols are the P/D protocols the Messages API runs on end to end, a 1P1D pool of
// the simulator each (responsesStacks'): vLLM's NixlConnector and MooncakeConnector, whose
// Messages handler takes kv_transfer_params, so the proxy sends the route as it came, and
// SGLang's, whose handler cannot pair legs, so the proxy serves it as a chat completion.
var messagesProtocols = responsesStacks

// native says a protocol's engines get the Messages request as it came (vLLM's), not the chat
// completion it stands for: their answer keeps vLLM's id, the chat's.
func native(protocol string) bool { return protocol != "sglang" }

func TestTheAnthropicSDKStreamsAndReadsWholeAnswersThroughPDOnEveryProtocol(t *testing.T) {
	for _, p := range messagesProtocols {
		t.Run(p.name, func(t *testing.T) {
			s, prefiller, decoder := p.start(t, func(p, d timing) {})
			client := anthropicClient(s)
			ctx := context.Background()
			params := agentTurn(7)
			before := kv(t, prefiller).RequestsTotal

			whole, err := client.Messages.New(ctx, params)
			if err != nil {
				t.Fatalf("messages: %v", err)
			}
			if whole.Role != "assistant" || len(whole.Content) != 1 || whole.Content[0].Type != "text" || whole.Content[0].Text == "" ||
				whole.StopReason != anthropic.StopReasonMaxTokens || whole.Usage.OutputTokens != 7 || whole.Usage.InputTokens == 0 {
				t.Fatalf("whole answer %+v", whole)
			}
			if got := kv(t, prefiller).RequestsTotal - before; got != 1 {
				t.Fatalf("the prefiller served %d requests for one answer; want it prefilled there", got)
			}
			if strings.HasPrefix(whole.ID, "chatcmpl-") != native(p.name) {
				t.Errorf("answer id %q: the engines' own Messages answer is vLLM's alone (chatcmpl-)", whole.ID)
			}

			stream := client.Messages.NewStreaming(ctx, params)
			var msg anthropic.Message
			var types []string
			for stream.Next() {
				ev := stream.Current()
				if len(types) == 0 || types[len(types)-1] != ev.Type {
					types = append(types, ev.Type)
				}
				if err := msg.Accumulate(ev); err != nil {
					t.Fatalf("accumulate %s: %v", ev.Type, err)
				}
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream: %v", err)
			}
			if got := strings.Join(types, " "); !strings.HasPrefix(got, "message_start") || !strings.HasSuffix(got, "content_block_start content_block_delta content_block_stop message_delta message_stop") {
				t.Errorf("events %s", got)
			}
			// Greedy on the same prompt: the stream says what the whole answer said.
			if len(msg.Content) != 1 || msg.Content[0].Text != whole.Content[0].Text || msg.StopReason != anthropic.StopReasonMaxTokens || msg.Usage.OutputTokens != 7 {
				t.Errorf("streamed %+v, want the whole answer's text %q", msg, whole.Content[0].Text)
			}
			if got := kv(t, prefiller).RequestsTotal - before; got != 2 {
				t.Errorf("the prefiller served %d requests for two answers; want both prefilled there", got)
			}
			quiet(t, s, prefiller, decoder)
		})
	}
}

func TestAMessagesAnswerIsTheChatAnswerOfItsConversation(t *testing.T) {
	// The engines render a Messages request as the chat completion it stands for: the same
	// prompt tokens, so the same greedy answer, on every protocol.
	for _, p := range messagesProtocols {
		t.Run(p.name, func(t *testing.T) {
			s, prefiller, decoder := p.start(t, func(p, d timing) {})
			ctx := context.Background()
			client := anthropicClient(s)
			msg, err := client.Messages.New(ctx, anthropic.MessageNewParams{Model: "sim", MaxTokens: 9,
				System:   []anthropic.TextBlockParam{{Text: "Be brief."}},
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Name a prime."))}})
			if err != nil {
				t.Fatal(err)
			}
			oai := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0), option.WithJSONSet("ignore_eos", true))
			chat, err := oai.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "sim", MaxTokens: openai.Int(9), Temperature: openai.Float(0),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Name a prime.")}})
			if err != nil {
				t.Fatal(err)
			}
			if msg.Content[0].Text != chat.Choices[0].Message.Content || msg.Usage.InputTokens != chat.Usage.PromptTokens {
				t.Errorf("messages %q (%d prompt tokens), chat %q (%d)", msg.Content[0].Text, msg.Usage.InputTokens, chat.Choices[0].Message.Content, chat.Usage.PromptTokens)
			}
			quiet(t, s, prefiller, decoder)
		})
	}
}

// A client that leaves a Messages stream at each stage of its P/D flow (its prefill, the
// decoder's pull of the KV, the decode) leaves nothing held on either engine, on every
// protocol.
func TestAMessagesStreamCutAtEachStageLeavesEveryEngineHoldingNothing(t *testing.T) {
	stages := []struct {
		name string
		slow func(p, d timing)
		// ready says the request reached the stage: its table state, whether a text delta
		// reached the client, what the decoder (its URL) is doing.
		ready func(s *stack, id string, gotText bool, decoder string) bool
	}{
		{"prefill", func(p, d timing) { *p.prefill = 400 * time.Millisecond },
			func(s *stack, id string, _ bool, _ string) bool {
				st, _ := s.m.Table.State(id)
				return st == lifecycle.Prefilling
			}},
		{"kv_pull", func(p, d timing) { *d.transfer = 10 * time.Millisecond },
			// The decoder has taken blocks to pull into, and nothing was generated yet.
			func(s *stack, id string, got bool, d string) bool { return !got && kv(s.t, d).BlocksInUse > 0 }},
		{"decode", func(p, d timing) { *d.itl = 20 * time.Millisecond },
			func(s *stack, id string, got bool, _ string) bool { return got }},
	}
	for _, p := range messagesProtocols {
		for _, stage := range stages {
			t.Run(p.name+"/"+stage.name, func(t *testing.T) {
				s, prefiller, decoder := p.start(t, stage.slow)
				for i := range 3 {
					id := fmt.Sprintf("msg-cut-%s-%d", stage.name, i)
					ctx, cancel := context.WithCancel(context.Background())
					body := `{"model":"sim","max_tokens":400,"stream":true,"ignore_eos":true,"system":"s","messages":[{"role":"user","content":"` + prompt(200) + `"}]}`
					got := make(chan bool, 1) // a text delta reached the client
					done := make(chan struct{})
					go func() {
						defer close(done)
						req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/messages", strings.NewReader(body))
						req.Header.Set("Content-Type", "application/json")
						req.Header.Set("X-Request-Id", id)
						resp, err := http.DefaultClient.Do(req)
						if err != nil {
							return
						}
						defer resp.Body.Close()
						sc := bufio.NewScanner(resp.Body)
						for sc.Scan() {
							if strings.HasPrefix(sc.Text(), "event: content_block_delta") {
								select {
								case got <- true:
								default:
								}
							}
						}
					}()
					testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
						return stage.ready(s, id, len(got) > 0, decoder), "request never reached the stage"
					})
					cancel()
					<-done
				}
				quiet(t, s, prefiller, decoder)
			})
		}
	}
}

func TestMessagesErrorsComeInAnthropicsShapeWhereverTheyStart(t *testing.T) {
	t.Setenv("PDPROXY_E2E_MESSAGES_KEYS", "k-good")
	s := startStack(t, sglangSims, func(c *app.Config) { c.Proxy.APIKeysEnv = "PDPROXY_E2E_MESSAGES_KEYS" })
	waitForModels(t, s) // until the engines list theirs, no model is known to be served by none
	for _, tc := range []struct {
		name, body, key string
		status          int
		typ             string
	}{
		{"max_tokens missing", `{"model":"sim","messages":[{"role":"user","content":"hi"}]}`, "k-good", 400, "invalid_request_error"},
		{"a role that is none", `{"model":"sim","max_tokens":5,"messages":[{"role":"robot","content":"hi"}]}`, "k-good", 400, "invalid_request_error"},
		{"a block of no known type", `{"model":"sim","max_tokens":5,"messages":[{"role":"user","content":[{"type":"video"}]}]}`, "k-good", 400, "invalid_request_error"},
		{"a model no engine serves", `{"model":"nope","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "k-good", 404, "not_found_error"},
		{"a wrong key in x-api-key", `{"model":"sim","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "k-bad", 401, "authentication_error"},
		{"no key", `{"model":"sim","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "", 401, "authentication_error"},
		{"not JSON", `{"model":`, "k-good", 400, "invalid_request_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, s.url+"/v1/messages", strings.NewReader(tc.body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("anthropic-version", "2023-06-01")
			if tc.key != "" {
				req.Header.Set("x-api-key", tc.key)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e struct {
				Type  string `json:"type"`
				Error struct {
					Type    string `json:"type"`
					Message string `json:"message"`
				} `json:"error"`
			}
			if err := json.Unmarshal(raw, &e); err != nil || resp.StatusCode != tc.status || e.Type != "error" || e.Error.Type != tc.typ || e.Error.Message == "" {
				t.Errorf("%d %s, want %d with an Anthropic error of type %s", resp.StatusCode, raw, tc.status, tc.typ)
			}
		})
	}
	// The SDK reads them as its own errors, and a good key in x-api-key is the client's key.
	good := anthropicClient(s, aoption.WithAPIKey("k-good"))
	_, err := good.Messages.New(context.Background(), anthropic.MessageNewParams{Model: "nope", MaxTokens: 3,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hi"))}})
	var ae *anthropic.Error
	if !errors.As(err, &ae) || ae.StatusCode != 404 || !strings.Contains(ae.Error(), "not_found_error") {
		t.Errorf("an unknown model through the SDK: %v", err)
	}
	if _, err := good.Messages.New(context.Background(), agentTurn(3)); err != nil {
		t.Errorf("a good key in x-api-key: %v", err)
	}
	// The OpenAI routes keep the OpenAI shape.
	resp := post(t, context.Background(), s.url+"/v1/chat/completions", `{"model":"sim"}`, "Authorization", "Bearer k-good")
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(raw), `"code":"invalid_value"`) {
		t.Errorf("a chat error: %s", raw)
	}

	// Behind the front, the decoder fails: on vLLM, whose engine streams the Messages events
	// the proxy passes on, and on SGLang, whose chat stream the proxy translates. Before the
	// first byte the client reads the proxy's status with an Anthropic error; once its stream
	// began, an error event in Anthropic's shape ends it, as Anthropic's API ends one, and no
	// message_stop comes.
	for _, proto := range []faultengine.Protocol{faultengine.VLLM, faultengine.SGLang} {
		for _, tc := range []struct {
			name   string
			fault  faultengine.Fault
			stream bool
			// status is the answer's status; 200 for a stream that failed after its first
			// events.
			status int
			typ    string
		}{
			{"a 500 from the engine", faultengine.Status500, false, http.StatusBadGateway, "api_error"},
			{"a 500 from the engine to a stream", faultengine.Status500, true, http.StatusBadGateway, "api_error"},
			{"an engine that never answers", faultengine.Silent, false, http.StatusGatewayTimeout, "timeout_error"},
			{"an engine that never answers a stream", faultengine.Silent, true, http.StatusGatewayTimeout, "timeout_error"},
			{"an engine that drops the connection mid-stream", faultengine.MidClose, true, http.StatusOK, "api_error"},
			{"an engine that goes silent mid-stream", faultengine.MidSilence, true, http.StatusOK, "timeout_error"},
		} {
			t.Run(string(proto)+"/"+tc.name, func(t *testing.T) {
				s := faultyDecoderStack(t, proto, tc.fault)
				body := `{"model":"m","max_tokens":8,"stream":` + fmt.Sprint(tc.stream) + `,"messages":[{"role":"user","content":"hi"}]}`
				resp := post(t, context.Background(), s.url+"/v1/messages", body, "anthropic-version", "2023-06-01")
				raw, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil {
					t.Fatalf("read the answer (%d): %v: %q", resp.StatusCode, err, raw)
				}
				if resp.StatusCode != tc.status {
					t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, raw)
				}
				errBody := raw
				if tc.status == http.StatusOK {
					events := sseNamedEvents(raw)
					last := events[len(events)-1]
					deltas := 0
					for _, ev := range events {
						if ev.name == "content_block_delta" {
							deltas++
						}
						if ev.name == "message_stop" {
							t.Errorf("a failed stream carried message_stop: %s", raw)
						}
					}
					if deltas == 0 || last.name != "error" {
						t.Fatalf("want text deltas, then an error event last; got %s", raw)
					}
					errBody = []byte(last.data)
				} else if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
					t.Errorf("content type %q, want JSON", ct)
				}
				var e struct {
					Type  string `json:"type"`
					Error struct {
						Type    string `json:"type"`
						Message string `json:"message"`
					} `json:"error"`
				}
				if err := json.Unmarshal(errBody, &e); err != nil || e.Type != "error" || e.Error.Type != tc.typ || e.Error.Message == "" {
					t.Errorf("%s, want an Anthropic error of type %s", errBody, tc.typ)
				}
				s.assertQuiet(10 * time.Second)
			})
		}
	}
}

// faultyDecoderStack runs pdproxy in front of a 1P1D pool of fault engines speaking proto,
// whose decoder performs fault, with short phase timeouts so that a silent engine times out
// quickly.
func faultyDecoderStack(t *testing.T, proto faultengine.Protocol, fault faultengine.Fault) *stack {
	t.Helper()
	rooms := faultengine.NewRooms()
	start := func(prefill bool, fault faultengine.Fault) *faultengine.Engine {
		e, err := faultengine.Start(faultengine.Config{Protocol: proto, Prefill: prefill, Fault: fault, Rooms: rooms})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close) // after the proxy's shutdown, registered later
		return e
	}
	p, d := start(true, faultengine.None), start(false, fault)
	s := startStack(t, func(c *app.Config) {
		c.Sims = nil
		prefiller := routerconfig.BackendConfig{Name: "fault-prefill", URL: p.URL(), Role: routerconfig.RolePrefill, Engine: string(proto)}
		if proto == faultengine.SGLang {
			prefiller.BootstrapPort = 8998 // what the fault engine's /server_info says
		}
		c.Router.Backends = []routerconfig.BackendConfig{prefiller, {Name: "fault-decode", URL: d.URL(), Role: routerconfig.RoleDecode, Engine: string(proto)}}
		c.Proxy.PrefillTimeout = 300 * time.Millisecond
		c.Proxy.DecodeFirstByteTimeout = 300 * time.Millisecond
		c.Proxy.DecodeIdleTimeout = 300 * time.Millisecond
	})
	waitForModels(t, s)
	return s
}

// namedEvent is one SSE event: its name and its data.
type namedEvent struct{ name, data string }

// sseNamedEvents reads an SSE body into its events, in order.
func sseNamedEvents(body []byte) []namedEvent {
	var out []namedEvent
	var cur namedEvent
	for _, line := range strings.Split(string(body), "\n") {
		switch {
		case line == "":
			if cur != (namedEvent{}) {
				out = append(out, cur)
			}
			cur = namedEvent{}
		case strings.HasPrefix(line, "event:"):
			cur.name = strings.TrimSpace(strings.TrimPrefix(line, "event:"))
		case strings.HasPrefix(line, "data:"):
			cur.data += strings.TrimSpace(strings.TrimPrefix(line, "data:"))
		}
	}
	if cur != (namedEvent{}) {
		out = append(out, cur)
	}
	return out
}

func TestAnEnginesRefusalOfAMessagesRequestReachesTheClientInAnthropicsShapeOnEveryProtocol(t *testing.T) {
	// vLLM's engines refuse a Messages request in Anthropic's shape themselves; SGLang's chat
	// refusal is given that shape by the proxy. Either way the client reads the engine's
	// status and message.
	for _, p := range messagesProtocols {
		t.Run(p.name, func(t *testing.T) {
			s, prefiller, decoder := p.start(t, func(p, d timing) {})
			resp := post(t, context.Background(), s.url+"/v1/messages", `{"model":"sim","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`,
				"X-Sim-Fail-Status", "400")
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e struct {
				Type  string `json:"type"`
				Error struct {
					Type    string `json:"type"`
					Message string `json:"message"`
				} `json:"error"`
			}
			if err := json.Unmarshal(raw, &e); err != nil || resp.StatusCode != http.StatusBadRequest || e.Type != "error" ||
				e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, "injected failure") {
				t.Errorf("%d %s, want the engine's 400 in Anthropic's shape", resp.StatusCode, raw)
			}
			quiet(t, s, prefiller, decoder)
		})
	}
}
