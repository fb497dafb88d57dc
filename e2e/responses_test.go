package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// timing is the knobs of one simulated engine a test slows down.
type timing struct{ prefill, transfer, itl *time.Duration }

// responsesStacks are the three P/D protocols, each a 1P1D pool of the simulator: vLLM's
// NixlConnector (the embedded default), SGLang's paired legs, vLLM's MooncakeConnector.
// slow changes the prefiller's and the decoder's timings; start returns the stack and the
// two engines' URLs.
var responsesStacks = []struct {
	name  string
	start func(t *testing.T, slow func(p, d timing)) (s *stack, prefiller, decoder string)
}{
	{"nixl", func(t *testing.T, slow func(p, d timing)) (*stack, string, string) {
		s := startStack(t, fastSims, func(c *app.Config) { slow(simTiming(&c.Sims[0]), simTiming(&c.Sims[1])) })
		return s, s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	}},
	{"sglang", func(t *testing.T, slow func(p, d timing)) (*stack, string, string) {
		s := startStack(t, sglangSims, func(c *app.Config) { slow(simTiming(&c.Sims[0]), simTiming(&c.Sims[1])) })
		return s, s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	}},
	{"mooncake", func(t *testing.T, slow func(p, d timing)) (*stack, string, string) {
		base := sim.DefaultConfig()
		base.Protocol, base.PrefillTime, base.ITL, base.KVHeartbeatInterval = sim.ProtocolMooncake, time.Millisecond, time.Millisecond, 0
		pc, dc := base, base
		pc.Role, pc.BootstrapPort, dc.Role = "prefill", 0, "decode" // a free port, read back below
		slow(timing{&pc.PrefillTime, &pc.KVTransferTime, &pc.ITL}, timing{&dc.PrefillTime, &dc.KVTransferTime, &dc.ITL})
		pe, purl := startSim(t, pc)
		_, durl := startSim(t, dc)
		cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
		cfg.Router.Backends = []routerconfig.BackendConfig{
			{Name: "p0", URL: purl, Role: routerconfig.RolePrefill, Engine: "mooncake", BootstrapPort: pe.BootstrapPort()},
			{Name: "d0", URL: durl, Role: routerconfig.RoleDecode, Engine: "mooncake"},
		}
		s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
		return s, purl, durl
	}},
}

func simTiming(c *app.SimConfig) timing { return timing{&c.PrefillTime, &c.KVTransferTime, &c.ITL} }

// quiet checks the stack's invariants and that both engines hold, run and wait for nothing.
func quiet(t *testing.T, s *stack, urls ...string) {
	t.Helper()
	testutil.WaitFor(t, 3*time.Second, func() (bool, string) {
		for _, u := range urls {
			st := kv(t, u)
			if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 ||
				st.RoomsWaiting != 0 || st.RoomsHeld != 0 || st.TransfersWaiting != 0 || st.DoubleFreeAttemptsTotal != 0 {
				return false, u + ": " + jsonString(st)
			}
		}
		return true, ""
	})
	testutil.WaitFor(t, 3*time.Second, func() (bool, string) {
		if n := s.m.Table.Len(); n != 0 {
			return false, fmt.Sprintf("%d requests in the table", n)
		}
		if h := s.m.Table.OutstandingHolds(); h != 0 {
			return false, fmt.Sprintf("%d holds outstanding", h)
		}
		for _, b := range s.m.Router.Backends() {
			if b.Inflight != 0 {
				return false, fmt.Sprintf("%s in flight %d", b.Name, b.Inflight)
			}
		}
		return true, ""
	})
}

func TestResponsesAPIThroughTheSDKOnEveryProtocol(t *testing.T) {
	for _, st := range responsesStacks {
		t.Run(st.name, func(t *testing.T) {
			s, prefiller, decoder := st.start(t, func(p, d timing) {})
			client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
				option.WithJSONSet("ignore_eos", true))
			ctx := context.Background()
			before := kv(t, prefiller).RequestsTotal

			resp, err := client.Responses.New(ctx, responses.ResponseNewParams{
				Model:           "sim",
				Instructions:    openai.String("answer briefly"),
				Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("what is disaggregated serving?")},
				MaxOutputTokens: openai.Int(9),
			})
			if err != nil {
				t.Fatal(err)
			}
			if resp.OutputText() == "" || resp.Model != "sim" {
				t.Fatalf("response %+v: no text, or the wrong model", resp)
			}
			if got := kv(t, prefiller).RequestsTotal - before; got != 1 {
				t.Fatalf("the prefiller served %d requests for one response; want it prefilled there", got)
			}

			stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{
				Model:           "sim",
				Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("stream an answer")},
				MaxOutputTokens: openai.Int(8),
			})
			var types []string
			text := ""
			for stream.Next() {
				ev := stream.Current()
				types = append(types, ev.Type)
				if ev.Type == "response.output_text.delta" {
					text += ev.Delta
				}
			}
			if err := stream.Err(); err != nil {
				t.Fatal(err)
			}
			if len(types) < 3 || types[0] != "response.created" || (types[len(types)-1] != "response.incomplete" && types[len(types)-1] != "response.completed") || text == "" {
				// max_output_tokens ends it: vLLM's last event is then response.incomplete.
				t.Fatalf("stream events %v, text %q: want response.created first, response.incomplete last, some text", types, text)
			}

			_, err = client.Responses.New(ctx, responses.ResponseNewParams{
				Model: "sim", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("go on")},
				PreviousResponseID: openai.String(resp.ID),
			})
			var apiErr *openai.Error
			if !asOpenAIError(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest || apiErr.Param != "previous_response_id" {
				t.Fatalf("previous_response_id under P/D: want a 400 naming it, got %v", err)
			}
			quiet(t, s, prefiller, decoder)
		})
	}
}

// A client that leaves a Responses stream at each stage of its P/D flow (its prefill, the
// decoder's pull of the KV, the decode) leaves nothing held on either engine, on every
// protocol.
func TestResponsesStreamCutAtEachStageLeavesNothingHeld(t *testing.T) {
	stages := []struct {
		name string
		slow func(p, d timing)
		// ready says the request reached the stage: its table state, whether a delta
		// reached the client, what the decoder (its URL) is doing.
		ready func(s *stack, id string, gotEvent bool, decoder string) bool
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
	for _, st := range responsesStacks {
		for _, stage := range stages {
			t.Run(st.name+"/"+stage.name, func(t *testing.T) {
				s, prefiller, decoder := st.start(t, stage.slow)
				for i := range 3 {
					id := fmt.Sprintf("resp-cut-%s-%d", stage.name, i)
					ctx, cancel := context.WithCancel(context.Background())
					body := `{"model":"sim","input":[{"role":"user","content":"` + prompt(200) + `"}],"max_output_tokens":400,"stream":true,"ignore_eos":true}`
					got := make(chan bool, 1) // a delta event reached the client
					done := make(chan struct{})
					go func() {
						defer close(done)
						req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/responses", strings.NewReader(body))
						req.Header.Set("X-Request-Id", id)
						resp, err := http.DefaultClient.Do(req)
						if err != nil {
							return
						}
						defer resp.Body.Close()
						sc := bufio.NewScanner(resp.Body)
						for sc.Scan() {
							if strings.HasPrefix(sc.Text(), "event: response.output_text.delta") {
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
