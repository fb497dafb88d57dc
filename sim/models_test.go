package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

func TestAnEngineServesItsModelsAndAdaptersAndRefusesOthersWithVLLMs404(t *testing.T) {
	cfg := fastConfig()
	cfg.Model = "llama-8b, llama-8b-instruct"
	cfg.LoRAModules = "sql-lora=/adapters/sql,chat-lora=/adapters/chat"
	ts := startServer(t, cfg)

	var models struct {
		Data []struct {
			ID     string  `json:"id"`
			Root   string  `json:"root"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.Unmarshal(ts.get(t, "/v1/models"), &models); err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, m := range models.Data {
		parent := "null"
		if m.Parent != nil {
			parent = *m.Parent
		}
		listed = append(listed, m.ID+" "+m.Root+" "+parent)
	}
	if want := "[llama-8b llama-8b null llama-8b-instruct llama-8b-instruct null sql-lora /adapters/sql llama-8b chat-lora /adapters/chat llama-8b]"; fmt.Sprint(listed) != want {
		t.Errorf("/v1/models lists %v, want %s", listed, want)
	}

	for _, tc := range []struct {
		name, path, body, model string // model: the one answered; "": a 404
	}{
		{"no model is the first", "/v1/completions", `{"prompt":"hi","max_tokens":1}`, "llama-8b"},
		{"the second name", "/v1/chat/completions", `{"model":"llama-8b-instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`, "llama-8b-instruct"},
		{"an adapter", "/v1/responses", `{"model":"sql-lora","input":"hi","max_output_tokens":1}`, "sql-lora"},
		{"an adapter's embeddings", "/v1/embeddings", `{"model":"chat-lora","input":"hi"}`, "chat-lora"},
		{"completions of another model", "/v1/completions", `{"model":"gpt-4","prompt":"hi"}`, ""},
		{"chat of another model", "/v1/chat/completions", `{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}`, ""},
		{"responses of another model", "/v1/responses", `{"model":"gpt-4","input":"hi"}`, ""},
		{"embeddings of another model", "/v1/embeddings", `{"model":"gpt-4","input":"hi"}`, ""},
		{"rerank of another model", "/rerank", `{"model":"gpt-4","query":"q","documents":["d"]}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), tc.path, tc.body, nil)
			b := readAll(t, resp)
			if tc.model != "" {
				var a struct {
					Model string `json:"model"`
				}
				if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &a) != nil || a.Model != tc.model {
					t.Errorf("status %d %s, want 200 from model %s", resp.StatusCode, b, tc.model)
				}
				return
			}
			want := "{\"error\":{\"message\":\"The model `gpt-4` does not exist.\",\"type\":\"NotFoundError\",\"param\":\"model\",\"code\":404}}\n"
			if resp.StatusCode != http.StatusNotFound || string(b) != want {
				t.Errorf("status %d %s, want 404 %s", resp.StatusCode, b, want)
			}
		})
	}
	if m := string(ts.get(t, "/metrics")); !strings.Contains(m, `vllm:num_requests_running{model_name="llama-8b"} 0`) {
		t.Errorf("/metrics is not labelled with the first model:\n%s", m)
	}
	ts.waitKV(t, "all free", allFree)
}

func TestPriorityIsRefusedWithoutThePriorityPolicyAsVLLMDoes(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, path := range []string{"/v1/completions", "/v1/embeddings"} {
		body := `{"prompt":"hi","priority":5}`
		if path == "/v1/embeddings" {
			body = `{"input":"hi","priority":5}`
		}
		resp := ts.post(t, context.Background(), path, body, nil)
		b := readAll(t, resp)
		want := `{"error":{"message":"Got priority 5 but Priority scheduling is not enabled.","type":"BadRequestError","param":null,"code":400}}` + "\n"
		if resp.StatusCode != http.StatusBadRequest || string(b) != want {
			t.Errorf("%s: status %d %s, want 400 %s", path, resp.StatusCode, b, want)
		}
	}
	resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":"hi","priority":0,"max_tokens":1}`, nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Errorf("priority 0 without the policy: status %d %s, want 200", resp.StatusCode, b)
	}
}

func TestThePriorityPolicyAdmitsTheLowestPriorityFirstAndCountsEachPriority(t *testing.T) {
	cfg := fastConfig()
	cfg.SchedulingPolicy = SchedulingPriority
	cfg.MaxRunning = 1
	ts := startServer(t, cfg)

	// A stream holds the only running slot until its client leaves.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	blocker := ts.post(t, ctx, "/v1/completions", `{"prompt":"hold","max_tokens":100000,"ignore_eos":true,"stream":true}`, nil)
	defer blocker.Body.Close()
	ts.waitKV(t, "the blocker runs", func(s KVStats) bool { return s.RunningRequests == 1 })

	order := make(chan string, 3)
	for i, p := range []int{7, 5, 0} {
		// Several tokens each: with one running slot, one ends a few steps before the next,
		// so the order the answers arrive in is the order they ran in.
		ans := ts.send(context.Background(), "/v1/completions", fmt.Sprintf(`{"prompt":"p%d","max_tokens":20,"ignore_eos":true,"priority":%d}`, p, p), nil)
		go func() {
			<-ans
			order <- fmt.Sprint(p)
		}()
		// One at a time: arrival order, priorities against it.
		ts.waitKV(t, "queued", func(s KVStats) bool { return s.RequestsTotal == i+2 && s.WaitingRequests == i+1 })
	}
	cancel()
	var got []string
	for range 3 {
		got = append(got, <-order)
	}
	if fmt.Sprint(got) != "[0 5 7]" {
		t.Errorf("finished in priority order %v, want [0 5 7]", got)
	}
	s := ts.waitKV(t, "all free", allFree)
	if fmt.Sprint(s.Priorities) != "map[0:2 5:1 7:1]" {
		t.Errorf("priorities %v, want the blocker and one request at 0, one at 5, one at 7", s.Priorities)
	}
}

func TestPriorityReachesBothLegsOfAPrefillAndDecode(t *testing.T) {
	cfg := fastConfig()
	cfg.SchedulingPolicy = SchedulingPriority
	p, d := startServer(t, cfg), startServer(t, cfg)
	prompt := strings.Repeat("abcd", 40)
	hdr := map[string]string{"X-Request-Id": "prio-pd"}
	resp := p.post(t, context.Background(), "/v1/responses", `{"input":"`+prompt+`","max_output_tokens":1,"priority":3,`+prefillKV+`}`, hdr)
	var pr struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if b := readAll(t, resp); json.Unmarshal(b, &pr) != nil || string(pr.KV) == "null" {
		t.Fatalf("prefill: %s", b)
	}
	resp = d.post(t, context.Background(), "/v1/responses", `{"input":"`+prompt+`","max_output_tokens":4,"priority":3,"kv_transfer_params":`+string(pr.KV)+`}`, hdr)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("decode: %d %s", resp.StatusCode, b)
	}
	p.waitKV(t, "P frees", allFree)
	for name, s := range map[string]KVStats{"P": p.kv(t), "D": d.waitKV(t, "D frees", allFree)} {
		if s.Priorities["3"] != 1 {
			t.Errorf("%s priorities %v, want one request at 3", name, s.Priorities)
		}
	}
}
