package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/enginemetrics"
)

func TestDataParallelHeaderPicksTheRank(t *testing.T) {
	for _, protocol := range []string{ProtocolVLLM, ProtocolSGLang, ProtocolMooncake} {
		t.Run(protocol, func(t *testing.T) {
			cfg := fastConfig()
			cfg.DataParallelSize = 2
			cfg.EngineID = "eng"
			cfg.BootstrapPort = 0
			if protocol != ProtocolVLLM {
				cfg.Protocol, cfg.Role = protocol, "decode"
			}
			ts := startSGLang(t, cfg)
			body := `{"prompt":"hello world","max_tokens":2,"ignore_eos":true}`
			for _, tc := range []struct {
				header     string
				wantStatus int
				wantRank   int // -1: none served it
			}{
				{"", http.StatusOK, 0},
				{"0", http.StatusOK, 0},
				{"1", http.StatusOK, 1},
				{"2", http.StatusBadRequest, -1},
				{"-1", http.StatusBadRequest, -1},
				{"one", http.StatusBadRequest, -1},
			} {
				before := ts.kv(t)
				hdr := map[string]string{}
				if tc.header != "" {
					hdr[HeaderDataParallelRank] = tc.header
				}
				a := recvAnswer(t, ts.send(context.Background(), "/v1/completions", body, hdr), "completion")
				if a.status != tc.wantStatus {
					t.Fatalf("rank header %q: answered %d %s, want %d", tc.header, a.status, a.body, tc.wantStatus)
				}
				if tc.wantRank < 0 {
					if !strings.Contains(a.body, "invalid_data_parallel_rank") {
						t.Errorf("rank header %q: answered %s, want code invalid_data_parallel_rank", tc.header, a.body)
					}
					continue
				}
				after := ts.waitKV(t, "the request ends", allFree)
				for r := range 2 {
					want := before.Ranks[r].RequestsTotal
					if r == tc.wantRank {
						want++
					}
					if got := after.Ranks[r].RequestsTotal; got != want {
						t.Errorf("rank header %q: rank %d requests_total = %d, want %d", tc.header, r, got, want)
					}
				}
				if after.RequestsTotal != after.Ranks[0].RequestsTotal+after.Ranks[1].RequestsTotal {
					t.Errorf("requests_total %d is not the sum of the ranks' %+v", after.RequestsTotal, after.Ranks)
				}
			}
			s := ts.kv(t)
			if s.BlocksTotal != 2*cfg.KVBlocks || s.Ranks[0].BlocksTotal != cfg.KVBlocks || s.Ranks[1].EngineID != "eng-dp1" || s.Ranks[0].EngineID != "eng" {
				t.Errorf("/debug/kv = %+v, want two pools of %d blocks, engine ids eng and eng-dp1", s, cfg.KVBlocks)
			}
			// A router reads both ranks' pools, as it reads both ranks' stored tokens.
			l, err := enginemetrics.Parse(ts.get(t, "/metrics"), enginemetrics.Families)
			if want := float64(2 * cfg.KVBlocks * cfg.BlockSize); err != nil || l.KV.Capacity != want {
				t.Errorf("a router reads the KV capacity as %v (error %v), want both ranks' %v", l.KV.Capacity, err, want)
			}
		})
	}
}

// A vLLM prefill on rank 1 names rank 1's engine id; the decoder's pull, sent to the
// server's one port, reaches that rank.
func TestDataParallelVLLMPrefillOnRankOneIsPulledFromRankOne(t *testing.T) {
	pcfg := fastConfig()
	pcfg.DataParallelSize = 2
	p, d := startServer(t, pcfg), startServer(t, fastConfig())
	body := `{"prompt":"` + strings.Repeat("w x y z ", 20) + `","max_tokens":3,"ignore_eos":true}`
	pa := recvAnswer(t, p.send(context.Background(), "/v1/completions",
		withKV(t, body, map[string]any{"do_remote_decode": true}, map[string]any{"max_tokens": 1}),
		map[string]string{"X-Request-Id": "dp", HeaderDataParallelRank: "1"}), "prefill")
	if pa.status != http.StatusOK {
		t.Fatalf("prefill answered %d %s", pa.status, pa.body)
	}
	held := p.kv(t)
	if held.Ranks[1].HeldRequests != 1 || held.Ranks[1].BlocksHeld == 0 || held.Ranks[0].HeldRequests != 0 || held.HeldRequests != 1 {
		t.Fatalf("prefiller /debug/kv = %+v, want rank 1 holding", held)
	}
	kv := completionKV(t, pa.body)
	if kv["remote_engine_id"] != held.Ranks[1].EngineID {
		t.Fatalf("prefill kv_transfer_params = %v, want rank 1's engine id %q", kv, held.Ranks[1].EngineID)
	}
	da := recvAnswer(t, d.send(context.Background(), "/v1/completions", withKV(t, body, kv, nil), map[string]string{"X-Request-Id": "dp"}), "decode")
	if got, want := decodedText(t, da, false), expectedText(0, "dp", 3); got != want {
		t.Errorf("decode text = %q, want %q", got, want)
	}
	p.waitKV(t, "rank 1 frees its hold once notified", allFree)
	if s := d.waitKV(t, "decoder done", allFree); s.KVBlocksPulledTotal == 0 {
		t.Errorf("decoder /debug/kv = %+v, want blocks pulled", s)
	}
}

// completionKV is the top-level kv_transfer_params of a whole answer.
func completionKV(t *testing.T, body string) map[string]any {
	t.Helper()
	var c struct {
		KV map[string]any `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal([]byte(body), &c); err != nil || c.KV == nil {
		t.Fatalf("answer %s: no kv_transfer_params (%v)", body, err)
	}
	return c.KV
}

// An SGLang room belongs to rank room % size, as SGLang's decoder picks its prefiller's
// rank: its prefill leg is served there, and elsewhere refused with a 400 naming the rank.
func TestDataParallelSGLangRoomIsServedOnRankRoomModSize(t *testing.T) {
	pcfg := sglangConfig("prefill")
	pcfg.DataParallelSize = 2
	pr := startPair(t, pcfg, sglangConfig("decode"))
	prompt := strings.Repeat("abcd ", 40)
	body := pr.leg(t, `{"prompt":"`+prompt+`","max_tokens":4,"ignore_eos":true}`, "sg-dp", 7, 1)

	wrong := recvAnswer(t, pr.p.send(context.Background(), "/v1/completions", body, map[string]string{HeaderDataParallelRank: "0"}), "prefill leg on rank 0")
	if wrong.status != http.StatusBadRequest || !strings.Contains(wrong.body, "rank 1") {
		t.Fatalf("room 7 on rank 0 answered %d %s, want a 400 naming rank 1", wrong.status, wrong.body)
	}
	pLeg := pr.p.send(context.Background(), "/v1/completions", body, map[string]string{HeaderDataParallelRank: "1"})
	dLeg := pr.d.send(context.Background(), "/v1/completions", body, nil)
	d, p := recvAnswer(t, dLeg, "decode leg"), recvAnswer(t, pLeg, "prefill leg")
	if p.status != http.StatusOK {
		t.Fatalf("prefill leg answered %d %s", p.status, p.body)
	}
	if got, want := decodedText(t, d, false), expectedText(0, "sg-dp", 4); got != want {
		t.Errorf("decode text = %q, want %q", got, want)
	}
	s := pr.p.waitKV(t, "the prefiller frees the room", sglangDone)
	if s.Ranks[1].HoldsTotal != 1 || s.Ranks[0].HoldsTotal != 0 {
		t.Errorf("prefiller /debug/kv = %+v, want the room held on rank 1", s)
	}
}

func TestDataParallelRanksPublishTheirOwnKVEvents(t *testing.T) {
	cfg := fastConfig()
	cfg.DataParallelSize = 2
	cfg.KVEventsEndpoint = "tcp://*:0"
	ts := startServer(t, cfg)
	addrs := ts.e.KVEventsAddrs()
	if len(addrs) != 2 || addrs[0] == addrs[1] {
		t.Fatalf("KVEventsAddrs = %q, want one endpoint per rank", addrs)
	}
	for rank, addr := range addrs {
		sub, _ := newSubscriber(t, "", false, strings.Replace(addr, "0.0.0.0", "127.0.0.1", 1))
		// A SUB socket misses what is published before its subscription arrives: send
		// prompts until one batch comes.
		var got wireBatch
		for i := 0; got.Events == nil; i++ {
			if i == 200 {
				t.Fatalf("rank %d published nothing on %s", rank, addr)
			}
			body := fmt.Sprintf(`{"prompt":"%s","max_tokens":1}`, strings.Repeat(fmt.Sprintf("r%d-%d ", rank, i), 40))
			a := recvAnswer(t, ts.send(context.Background(), "/v1/completions", body, map[string]string{HeaderDataParallelRank: fmt.Sprint(rank)}), "completion")
			if a.status != http.StatusOK {
				t.Fatalf("completion on rank %d answered %d %s", rank, a.status, a.body)
			}
			select {
			case m := <-sub.msgs:
				got = decodeMsg(t, m, "")
			case <-time.After(20 * time.Millisecond):
			}
		}
		if got.Rank != int64(rank) {
			t.Errorf("rank %d's batch carries rank %d", rank, got.Rank)
		}
	}
}
