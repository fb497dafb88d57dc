package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// mooncakePool starts np simulated Mooncake prefillers and nd decoders of ranks ranks each,
// and the proxy in front of them, which declares their ranks.
func mooncakePool(t *testing.T, np, nd, ranks int, hold time.Duration) (*stack, []*sim.Engine) {
	t.Helper()
	base := sim.DefaultConfig()
	base.Protocol, base.PrefillTime, base.ITL, base.KVHeartbeatInterval = sim.ProtocolMooncake, time.Millisecond, time.Millisecond, 0
	base.DataParallelSize = ranks
	base.KVHoldTimeout = hold
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	var engines []*sim.Engine
	for i := range np {
		pc := base
		pc.Role, pc.BootstrapPort = "prefill", 0 // a free port, read back below
		e, url := startSim(t, pc)
		engines = append(engines, e)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("p%d", i), URL: url, Role: routerconfig.RolePrefill,
			Engine: "mooncake", BootstrapPort: e.BootstrapPort(), DataParallelSize: ranks})
	}
	for i := range nd {
		dc := base
		dc.Role = "decode"
		e, url := startSim(t, dc)
		engines = append(engines, e)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: url, Role: routerconfig.RoleDecode,
			Engine: "mooncake", DataParallelSize: ranks})
	}
	return startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg), engines
}

// idle reports whether every engine holds, runs and waits for nothing.
func idle(engines []*sim.Engine) (bool, string) {
	for i, e := range engines {
		st := e.Stats()
		if st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 || st.BlocksFree != st.BlocksTotal || st.TransfersWaiting != 0 {
			return false, fmt.Sprintf("engine %d: %+v", i, st)
		}
	}
	return true, ""
}

func TestMooncakePoolsServeTheSDK(t *testing.T) {
	for _, tc := range []struct {
		name          string
		np, nd, ranks int
	}{{"1P1D", 1, 1, 1}, {"2P2D with two ranks each", 2, 2, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			s, engines := mooncakePool(t, tc.np, tc.nd, tc.ranks, 480*time.Second)
			client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
				option.WithJSONSet("ignore_eos", true))
			ctx := context.Background()
			for round := range 3 { // every rank gets some
				resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "sim",
					Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(fmt.Sprintf("say something %d", round))}, MaxTokens: openai.Int(5)})
				if err != nil || len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
					t.Fatalf("chat: %+v, %v", resp, err)
				}
				stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: "sim",
					Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream please")}, MaxTokens: openai.Int(6)})
				chunks := 0
				for stream.Next() {
					chunks++
				}
				if err := stream.Err(); err != nil || chunks < 2 {
					t.Fatalf("chat stream: %d chunks, %v", chunks, err)
				}
				c, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "sim",
					Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")}, MaxTokens: openai.Int(4)})
				if err != nil || len(c.Choices) != 1 || c.Choices[0].Text == "" {
					t.Fatalf("completion: %+v, %v", c, err)
				}
				cs := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: "sim",
					Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("stream a completion")}, MaxTokens: openai.Int(4)})
				text := ""
				for cs.Next() {
					for _, ch := range cs.Current().Choices {
						text += ch.Text
					}
				}
				if err := cs.Err(); err != nil || text == "" {
					t.Fatalf("completion stream %q, %v", text, err)
				}
			}
			testutil.WaitFor(t, 5*time.Second, func() (bool, string) { return idle(engines) })
			var pulled int
			for _, e := range engines {
				pulled += e.Stats().KVBlocksPulledTotal
			}
			if pulled == 0 {
				t.Error("no decoder pulled a block: the legs were not paired")
			}
			if tc.ranks > 1 {
				for i, e := range engines {
					for _, r := range e.Stats().Ranks {
						if r.RequestsTotal == 0 {
							t.Errorf("engine %d rank %d served nothing: the proxy does not spread over ranks", i, r.Rank)
						}
					}
				}
			}
		})
	}
}

// TestMooncakeGiveUpStormLeavesEveryEngineIdle: clients that give up at random moments, on a
// 2P2D pool with two ranks each. Within a second of the last, no engine runs, waits for or
// holds anything and the proxy holds nothing. The engines' own hold is a minute, so none of
// it is their timer: a decode leg cut after its decoder claimed the transfer tells the
// prefiller (vLLM's decoder does, for a request aborted before its pull), and one cut before
// leaves the prefill to the proxy's drain leg.
func TestMooncakeGiveUpStormLeavesEveryEngineIdle(t *testing.T) {
	const hold = time.Minute
	s, engines := mooncakePool(t, 2, 2, 2, hold)
	const n = 60
	rng := rand.New(rand.NewPCG(7, 8))
	delays := make([]time.Duration, n)
	for i := range delays {
		delays[i] = time.Duration(rng.IntN(12)) * time.Millisecond
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), delays[i])
			defer cancel()
			body := fmt.Sprintf(`{"model":"sim","prompt":"storm %d %s","max_tokens":40,"ignore_eos":true,"stream":%v}`, i, strings.Repeat("x ", 50), i%2 == 0)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		for i, e := range engines {
			if st := e.Stats(); st.RunningRequests != 0 || st.WaitingRequests != 0 || st.TransfersWaiting != 0 {
				return false, fmt.Sprintf("engine %d still works: %+v", i, st)
			}
		}
		if n := s.m.Table.OutstandingHolds(); n != 0 || s.m.Table.Len() != 0 {
			return false, fmt.Sprintf("the proxy still has %d requests and %d holds", s.m.Table.Len(), n)
		}
		return true, ""
	})
	testutil.WaitFor(t, time.Second, func() (bool, string) { return idle(engines) })
}
