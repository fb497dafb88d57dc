package e2e

import (
	"context"
	"fmt"
	"strings"
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

// migrationPool starts, on their own listeners, a simulated prefiller (none for decode-only)
// and two decoders of protocol, and the proxy with migration_limit 3 in front of them.
func migrationPool(t *testing.T, protocol string, pd bool, edit ...func(*app.Config)) (*stack, *sim.Server, []*sim.Server) {
	t.Helper()
	base := sim.DefaultConfig()
	base.Protocol, base.PrefillTime, base.ITL, base.KVHeartbeatInterval = protocol, time.Millisecond, 4*time.Millisecond, 0
	kind := "vllm"
	if protocol == sim.ProtocolMooncake {
		kind = "mooncake"
	}
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Proxy.MigrationLimit = 3
	logger := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
	start := func(c sim.Config) *sim.Server {
		s, err := sim.Listen(c, "127.0.0.1:0", logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	var p *sim.Server
	if pd {
		pc := base
		pc.Role = "prefill"
		pc.BootstrapPort = 0 // a free port, read back below
		p = start(pc)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: "p0", URL: p.URL(), Role: routerconfig.RolePrefill,
			Engine: kind, BootstrapPort: p.Engine().BootstrapPort()})
	}
	var ds []*sim.Server
	for i := range 2 {
		dc := base
		if pd {
			dc.Role = "decode"
		}
		d := start(dc)
		ds = append(ds, d)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: d.URL(), Role: routerconfig.RoleDecode, Engine: kind})
	}
	for _, e := range edit {
		e(&cfg)
	}
	return startConfig(t, logger, cfg), p, ds
}

// TestTheSDKReadsOneWholeAnswerThroughADecoderKilledMidStream: a greedy stream, completions
// and chat, P/D and decode-only, NIXL and Mooncake; its decoder is killed (as SIGKILL would:
// every connection cut, nothing listening) after a few tokens. The Go SDK reads one stream to
// its end, with no error, whose text is the unbroken answer's, and nothing is left held.
func TestTheSDKReadsOneWholeAnswerThroughADecoderKilledMidStream(t *testing.T) {
	for _, protocol := range []string{sim.ProtocolVLLM, sim.ProtocolMooncake} {
		for _, pd := range []bool{true, false} {
			if protocol == sim.ProtocolMooncake && !pd {
				continue // a Mooncake decoder without a prefiller is a vLLM decoder: covered
			}
			for _, chat := range []bool{false, true} {
				name := fmt.Sprintf("%s/pd=%v/chat=%v", protocol, pd, chat)
				t.Run(name, func(t *testing.T) {
					s, p, ds := migrationPool(t, protocol, pd)
					client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
						option.WithJSONSet("ignore_eos", true))
					const n = 40
					read := func(ctx context.Context, client openai.Client, kill func()) (string, error) {
						var sb strings.Builder
						chunks := 0
						if chat {
							st := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: "sim", MaxTokens: openai.Int(n),
								Temperature: openai.Float(0), Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("tell me a story")}})
							for st.Next() {
								for _, c := range st.Current().Choices {
									sb.WriteString(c.Delta.Content)
								}
								if chunks++; chunks == 8 && kill != nil {
									kill()
								}
							}
							return sb.String(), st.Err()
						}
						st := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: "sim", MaxTokens: openai.Int(n),
							Temperature: openai.Float(0), Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")}})
						for st.Next() {
							for _, c := range st.Current().Choices {
								sb.WriteString(c.Text)
							}
							if chunks++; chunks == 8 && kill != nil {
								kill()
							}
						}
						return sb.String(), st.Err()
					}
					var victim *sim.Server
					got, err := read(context.Background(), client, func() {
						for _, d := range ds {
							if d.Engine().Stats().RunningRequests > 0 {
								victim = d
							}
						}
						if victim == nil {
							t.Error("no decoder runs the stream")
							return
						}
						victim.Kill()
					})
					if err != nil {
						t.Fatalf("the stream through a killed decoder failed: %v (read %q)", err, got)
					}
					// The unbroken answer, from a decoder that was never killed, asked directly.
					var survivor *sim.Server
					for _, d := range ds {
						if d != victim {
							survivor = d
						}
					}
					direct := openai.NewClient(option.WithBaseURL(survivor.URL()+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
						option.WithJSONSet("ignore_eos", true))
					want, err := read(context.Background(), direct, nil)
					if err != nil {
						t.Fatalf("the unbroken run: %v", err)
					}
					if got != want || strings.Count(got, " tok") != n {
						t.Fatalf("answer through the killed decoder\n%q\nwant the unbroken one's\n%q", got, want)
					}
					survivors := []*sim.Engine{}
					for _, d := range ds {
						if d != victim {
							survivors = append(survivors, d.Engine())
						}
					}
					if p != nil {
						survivors = append(survivors, p.Engine())
					}
					testutil.WaitFor(t, 5*time.Second, func() (bool, string) { return idle(survivors) })
					testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
						return s.m.Table.Len() == 0 && s.m.Table.OutstandingHolds() == 0, fmt.Sprintf("table %+v, %d holds", s.m.Table.Snapshot(), s.m.Table.OutstandingHolds())
					})
					for _, b := range s.m.Router.Backends() {
						if b.Inflight != 0 {
							t.Errorf("backend %s in-flight %d", b.Name, b.Inflight)
						}
					}
					if v := testutil.Value(t, s.m.Registry, "pdproxy_migrations_total", map[string]string{"outcome": "migrated"}); v != 1 {
						t.Errorf("migrations{migrated} = %v, want 1", v)
					}
				})
			}
		}
	}
}

// TestRequestsRightAfterADecoderDiedAreServedOnFreshPairs: a decoder is killed before the
// proxy's checks could notice; the requests that were to go to it (its pick, a Mooncake
// pair's decode leg refused at connect) are served whole on a fresh pair, streamed or not.
func TestRequestsRightAfterADecoderDiedAreServedOnFreshPairs(t *testing.T) {
	for _, protocol := range []string{sim.ProtocolVLLM, sim.ProtocolMooncake} {
		t.Run(protocol, func(t *testing.T) {
			// d0, the heavier, is every first pick while it is up; no check notices its death
			// before a request does.
			s, p, ds := migrationPool(t, protocol, true, func(c *app.Config) {
				c.Router.Backends[1].Weight = 2
				c.Router.Health.Interval = -1
			})
			ds[0].Kill()
			// ignore_eos: an answer cut short by the sim's end of sequence would have no text.
			client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
				option.WithJSONSet("ignore_eos", true))
			for i := range 6 {
				params := openai.CompletionNewParams{Model: "sim", MaxTokens: openai.Int(6),
					Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(fmt.Sprintf("request %d", i))}}
				if i%2 == 0 {
					c, err := client.Completions.New(context.Background(), params)
					if err != nil || len(c.Choices) != 1 || c.Choices[0].Text == "" {
						t.Fatalf("request %d: %v %+v", i, err, c)
					}
					continue
				}
				st := client.Completions.NewStreaming(context.Background(), params)
				var sb strings.Builder
				for st.Next() {
					for _, c := range st.Current().Choices {
						sb.WriteString(c.Text)
					}
				}
				if err := st.Err(); err != nil || sb.Len() == 0 {
					t.Fatalf("stream %d: %v (read %q)", i, err, sb.String())
				}
			}
			if n := testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", map[string]string{"backend": "d0"}); n == 0 {
				t.Error("no request went to the dead decoder: the test tried nothing")
			}
			testutil.WaitFor(t, 5*time.Second, func() (bool, string) { return idle([]*sim.Engine{p.Engine(), ds[1].Engine()}) })
			testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
				return s.m.Table.Len() == 0 && s.m.Table.OutstandingHolds() == 0, fmt.Sprintf("table %+v, %d holds", s.m.Table.Snapshot(), s.m.Table.OutstandingHolds())
			})
		})
	}
}
