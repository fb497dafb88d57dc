package sim

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// loadGauges is what a router reads of an engine's load on /metrics: its load gauges and its
// count of requests taken in.
type loadGauges struct{ waiting, running, usage, requests float64 }

// scrapeLoad reads the load gauges of family ("vllm" or "sglang") from url's /metrics, as a
// proxy's router scrapes them, and fails if the other family is there too.
func scrapeLoad(t *testing.T, client *http.Client, url, family string) loadGauges {
	t.Helper()
	names := map[string][4]string{
		"vllm":   {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
		"sglang": {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total"},
	}
	g := testutil.Scrape(client, url+"/metrics")
	var out [4]float64
	for i, name := range names[family] {
		v, ok := testutil.Lookup(t, g, name, map[string]string{"model_name": "sim"})
		if !ok {
			t.Fatalf("/metrics lacks %s", name)
		}
		out[i] = v
	}
	for fam, other := range names {
		if fam == family {
			continue
		}
		for _, name := range other {
			if _, ok := testutil.Lookup(t, g, name, nil); ok {
				t.Errorf("/metrics of a %s engine has %s", family, name)
			}
		}
	}
	return loadGauges{out[0], out[1], out[2], out[3]}
}

func TestLoadGaugesFollowTheEnginesState(t *testing.T) {
	tests := []struct {
		name     string
		protocol string
		// script acts on a scripted engine of 16 blocks of 16 tokens and 2 running slots.
		script func(t *testing.T, p *scripted)
		want   loadGauges
	}{
		{
			name:   "an idle engine reports nothing waiting, nothing running, no KV used",
			script: func(*testing.T, *scripted) {},
		},
		{
			name: "requests submitted before the scheduler's next step are waiting, not yet counted",
			script: func(t *testing.T, p *scripted) {
				for _, rid := range []string{"a", "b", "c"} {
					if err := p.submit(p.request(t, rid, kindAggregated, 32, 100, nil)); err != nil {
						t.Fatal(err)
					}
				}
			},
			want: loadGauges{waiting: 3},
		},
		{
			name: "past the running slots the rest wait, and only the running hold blocks",
			script: func(t *testing.T, p *scripted) {
				for _, rid := range []string{"a", "b", "c"} {
					if err := p.submit(p.request(t, rid, kindAggregated, 32, 100, nil)); err != nil {
						t.Fatal(err)
					}
				}
				p.stepNow()
			},
			want: loadGauges{waiting: 1, running: 2, usage: 4.0 / 16, requests: 3},
		},
		{
			name: "a request waits for KV blocks while a slot is free",
			script: func(t *testing.T, p *scripted) {
				for _, rid := range []string{"first", "second"} {
					if err := p.submit(p.request(t, rid, kindAggregated, 200, 100, nil)); err != nil { // 13 blocks
						t.Fatal(err)
					}
				}
				p.stepNow()
			},
			want: loadGauges{waiting: 1, running: 1, usage: 13.0 / 16, requests: 2},
		},
		{
			name: "a prefill holding KV for a decoder runs nothing but uses its blocks",
			script: func(t *testing.T, p *scripted) {
				p.holdPrefill(t, "held")
			},
			want: loadGauges{usage: 2.0 / 16, requests: 1},
		},
		{
			name:     "an SGLang engine reports the same state under SGLang's names",
			protocol: ProtocolSGLang,
			script: func(t *testing.T, p *scripted) {
				for _, rid := range []string{"a", "b", "c"} {
					if err := p.submit(p.request(t, rid, kindAggregated, 32, 100, nil)); err != nil {
						t.Fatal(err)
					}
				}
				p.stepNow()
			},
			want: loadGauges{waiting: 1, running: 2, usage: 4.0 / 16, requests: 3},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := scriptedConfig()
			cfg.MaxRunning = 2
			family := "vllm"
			if tt.protocol == ProtocolSGLang {
				cfg.Protocol, cfg.Role, family = ProtocolSGLang, "decode", "sglang"
			}
			p := newScripted(t, cfg, newFakeClock())
			tt.script(t, p)
			srv := httptest.NewServer(p.Handler()) // no Run: /metrics reads the scripted state
			defer srv.Close()
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			if got := scrapeLoad(t, client, srv.URL, family); got != tt.want {
				t.Errorf("/metrics load = %+v, want %+v (/debug/kv %+v)", got, tt.want, p.Stats())
			}
		})
	}
}

func TestSGLangDecodeWaitingForItsRoomIsInThePreallocQueueGauge(t *testing.T) {
	pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
	d := pr.d.send(context.Background(), "/v1/completions", pr.leg(t, `{"prompt":"hi"}`, "r", 1, 1), nil)
	pr.d.waitKV(t, "the decode waits for its room", func(s KVStats) bool { return s.RoomsWaiting == 1 })
	g := testutil.Scrape(pr.d.client, pr.d.srv.URL+"/metrics")
	if v := testutil.Value(t, g, "sglang:num_decode_prealloc_queue_reqs", nil); v != 1 {
		t.Errorf("sglang:num_decode_prealloc_queue_reqs = %v, want 1", v)
	}
	if got := scrapeLoad(t, pr.d.client, pr.d.srv.URL, "sglang"); got != (loadGauges{}) {
		t.Errorf("load of a decoder whose only request waits for its room = %+v, want none: it holds no slot and no block", got)
	}
	pr.d.abort(t, "r", false)
	abortedAnswer(t, recvAnswer(t, d, "decode"), "decode")
	pr.checkClean(t)
}
