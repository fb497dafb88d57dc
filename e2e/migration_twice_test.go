package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// TestAStreamMovedTwiceGetsEveryTokenItAskedFor: a greedy completions stream of 40 tokens,
// decode-only on three simulated decoders, whose decoder is killed after 8 tokens and whose
// second decoder is killed after 16: it goes on on the third and ends with all 40 tokens, the
// unbroken answer's.
func TestAStreamMovedTwiceGetsEveryTokenItAskedFor(t *testing.T) {
	s, ds := greedyDecoders(t, 3, nil)
	const n = 40
	body := greedyBody(n)
	read := func(url string, kill func(chunk int)) (string, int) { return readGreedy(t, url, body, kill) }
	busy := func() *sim.Server {
		for _, d := range ds {
			select {
			case <-d.Died():
				continue
			default:
			}
			if d.Engine().Stats().RunningRequests > 0 {
				return d
			}
		}
		t.Fatal("no decoder runs the stream")
		return nil
	}
	got, tokens := read(s.url, func(chunk int) {
		if chunk == 8 || chunk == 16 {
			busy().Kill()
		}
	})
	var survivor *sim.Server
	for _, d := range ds {
		select {
		case <-d.Died():
		default:
			survivor = d
		}
	}
	if survivor == nil {
		t.Fatal("every decoder died")
	}
	want, _ := read(survivor.URL(), nil)
	if tokens != n || got != want {
		t.Fatalf("the stream moved twice read %d tokens, want %d:\n%q\nwant the unbroken answer\n%q", tokens, n, got, want)
	}
}

// readGreedy streams body from url's completions and gives back its text and its number of
// text events, calling kill (if any) after each.
func readGreedy(t *testing.T, url, body string, kill func(chunk int)) (text string, tokens int) {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	var sb strings.Builder
	for sc.Scan() {
		payload, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok || string(payload) == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(payload, &ev); err != nil {
			t.Fatalf("event %s: %v", payload, err)
		}
		for _, c := range ev.Choices {
			sb.WriteString(c.Text)
			tokens++
			if kill != nil {
				kill(tokens)
			}
		}
	}
	return sb.String(), tokens
}

// TestAStreamGoesBackToADecoderItLeftOnceThatDecoderIsBack: two decoders; the stream's
// decoder is killed after 8 tokens and restarted, and once the proxy's checks have seen it up
// again the second decoder is killed after 16: the stream goes back to the first, a new
// engine now, and ends with all 40 tokens, the unbroken answer's.
func TestAStreamGoesBackToADecoderItLeftOnceThatDecoderIsBack(t *testing.T) {
	s, ds := greedyDecoders(t, 2, func(c *app.Config) {
		c.Router.Health = routerconfig.HealthConfig{Interval: 20 * time.Millisecond, Timeout: time.Second, HealthyThreshold: 1, UnhealthyThreshold: 1}
	})
	const n = 40
	body := greedyBody(n)
	busy := func() int {
		for i, d := range ds {
			if d.Engine().Stats().RunningRequests > 0 {
				return i
			}
		}
		t.Fatal("no decoder runs the stream")
		return -1
	}
	first := -1
	got, tokens := readGreedy(t, s.url, body, func(chunk int) {
		switch chunk {
		case 8:
			first = busy()
			ds[first].Kill()
			testutil.Eventually(t, testutil.Timeout, func() bool {
				return !viewBackend(t, s.url, fmt.Sprintf("d%d", first)).Healthy
			}, "the proxy to see the killed decoder down")
			if err := ds[first].Restart(); err != nil {
				t.Fatal(err)
			}
			testutil.Eventually(t, testutil.Timeout, func() bool {
				return viewBackend(t, s.url, fmt.Sprintf("d%d", first)).Healthy
			}, "the proxy to see the restarted decoder up")
		case 16:
			if second := busy(); second == first {
				t.Fatalf("the stream went back to d%d before its second decoder died", first)
			} else {
				ds[second].Kill()
			}
		}
	})
	want, _ := readGreedy(t, ds[first].URL(), body, nil)
	if tokens != n || got != want {
		t.Fatalf("the stream read %d tokens, want %d:\n%q\nwant the unbroken answer\n%q", tokens, n, got, want)
	}
}

// greedyDecoders starts n simulated vLLM decoders, each an HTTP server of its own that can be
// killed, and the proxy in front of them decode-only with migration_limit 3, changed by mutate.
func greedyDecoders(t *testing.T, n int, mutate func(*app.Config)) (*stack, []*sim.Server) {
	t.Helper()
	base := sim.DefaultConfig()
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, 4*time.Millisecond, 0
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Proxy.MigrationLimit = 3
	logger := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
	var ds []*sim.Server
	for i := range n {
		d, err := sim.Listen(base, "127.0.0.1:0", logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds = append(ds, d)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: d.URL(), Role: routerconfig.RoleDecode, Engine: "vllm"})
	}
	if mutate != nil {
		mutate(&cfg)
	}
	return startConfig(t, logger, cfg), ds
}

// greedyBody is a greedy completions stream of n tokens.
func greedyBody(n int) string {
	return fmt.Sprintf(`{"model":"sim","prompt":"once upon a time","max_tokens":%d,"ignore_eos":true,"temperature":0,"stream":true}`, n)
}
