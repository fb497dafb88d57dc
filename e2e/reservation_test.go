package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// afterPrefillBeside starts, on loopback, a simulated vLLM NIXL prefiller and decoder serving
// model "nixl" and a paired prefiller and decoder of protocol (SGLang or Mooncake) serving
// model "paired", and the proxy in front of all four with decoder_reservation after_prefill.
// It returns the engines, the NIXL pair first.
func afterPrefillBeside(t *testing.T, protocol string) (*stack, []*sim.Engine) {
	t.Helper()
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
	var engines []*sim.Engine
	add := func(proto, kind, model string, role routerconfig.Role) {
		sc := sim.DefaultConfig()
		sc.Protocol, sc.Role, sc.Model = proto, string(role), model
		sc.PrefillTime, sc.ITL, sc.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
		b := routerconfig.BackendConfig{Name: fmt.Sprintf("%s-%s", model, role), Role: role, Engine: kind, Models: []string{model}}
		if proto == sim.ProtocolMooncake {
			sc.KVHoldTimeout = 480 * time.Second // what the backend's engine kind declares
		}
		if proto != sim.ProtocolVLLM && role == routerconfig.RolePrefill {
			sc.BootstrapPort = 0 // a free port, read back below
		}
		e, url := startSim(t, sc)
		b.URL = url
		if proto != sim.ProtocolVLLM && role == routerconfig.RolePrefill {
			b.BootstrapPort = e.BootstrapPort()
		}
		engines = append(engines, e)
		cfg.Router.Backends = append(cfg.Router.Backends, b)
	}
	add(sim.ProtocolVLLM, "vllm", "nixl", routerconfig.RolePrefill)
	add(sim.ProtocolVLLM, "vllm", "nixl", routerconfig.RoleDecode)
	add(protocol, protocol, "paired", routerconfig.RolePrefill)
	add(protocol, protocol, "paired", routerconfig.RoleDecode)
	return startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg), engines
}

// With decoder_reservation after_prefill, a model that only paired engines serve is served by
// them, their decoder reserved together with their prefiller since both legs go out at once,
// while a model of the vLLM NIXL pool beside them is prefilled first and decoded after; every
// request is answered whole, and nothing is left held on any engine or in the proxy.
func TestAfterPrefillReservationServesAPairedPoolBesideASequentialOne(t *testing.T) {
	for _, protocol := range []string{sim.ProtocolSGLang, sim.ProtocolMooncake} {
		t.Run(protocol, func(t *testing.T) {
			s, engines := afterPrefillBeside(t, protocol)
			nixlP, nixlD, pairedP, pairedD := engines[0], engines[1], engines[2], engines[3]
			requests := []struct {
				route, model string
				stream       bool
			}{
				{"/v1/completions", "paired", false},
				{"/v1/chat/completions", "paired", true},
				{"/v1/completions", "nixl", false},
				{"/v1/chat/completions", "nixl", true},
			}
			for _, r := range requests {
				body := fmt.Sprintf(`{"model":%q,"prompt":"%s","max_tokens":6,"ignore_eos":true,"stream":%v}`, r.model, prompt(40), r.stream)
				if r.route == "/v1/chat/completions" {
					body = fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"%s"}],"max_tokens":6,"ignore_eos":true,"stream":%v}`, r.model, prompt(40), r.stream)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				resp := post(t, ctx, s.url+r.route, body)
				answer, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				cancel()
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("%s for model %s: %d %s %v", r.route, r.model, resp.StatusCode, answer, err)
				}
				if tokens, _, done := tokensOf(t, answer, r.stream); tokens != 6 || !done {
					t.Errorf("%s for model %s: %d tokens (ended: %v), want 6: %s", r.route, r.model, tokens, done, answer)
				}
			}
			// Each pool served its own model's two requests: the paired decoder pulled its
			// prefiller's KV, the NIXL decoder its own.
			for name, e := range map[string]*sim.Engine{"nixl prefiller": nixlP, "nixl decoder": nixlD, "paired prefiller": pairedP, "paired decoder": pairedD} {
				if n := e.Stats().RequestsTotal; n != 2 {
					t.Errorf("%s took %d requests, want 2", name, n)
				}
			}
			for name, e := range map[string]*sim.Engine{"nixl decoder": nixlD, "paired decoder": pairedD} {
				if e.Stats().KVBlocksPulledTotal == 0 {
					t.Errorf("%s pulled no block: %s", name, jsonString(e.Stats()))
				}
			}
			testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
				if ok, why := idle(engines); !ok {
					return false, why
				}
				for i, e := range engines {
					if st := e.Stats(); !sglangIdle(st) {
						return false, fmt.Sprintf("engine %d: %s", i, jsonString(st))
					}
				}
				return true, ""
			})
			s.assertQuiet(5 * time.Second)
		})
	}
}
