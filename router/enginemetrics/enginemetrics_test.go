package enginemetrics

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// sglangMetrics is an SGLang /metrics body reporting queued and running requests and KV usage.
func sglangMetrics(queued, running int, usage float64) string {
	return fmt.Sprintf(`# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} %d
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} %d
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} %g
`, queued, running, usage)
}

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		body    string
		names   []Names
		want    Load
		wantErr string
	}{
		{
			name:  "vLLM's gauges",
			body:  testutil.VLLMMetrics(3, 5, 0.25),
			names: Families,
			want:  Load{Waiting: 3, Running: 5, Usage: 0.25, Requests: -1},
		},
		{
			name:  "SGLang's gauges, found by trying the families",
			body:  sglangMetrics(2, 7, 0.5),
			names: Families,
			want:  Load{Waiting: 2, Running: 7, Usage: 0.5, Requests: -1},
		},
		{
			name:  "the engine's own names win over another family in the same body",
			body:  testutil.VLLMMetrics(9, 9, 0.9) + sglangMetrics(1, 2, 0.3),
			names: []Names{{Waiting: "sglang:num_queue_reqs", Running: "sglang:num_running_reqs", Usage: "sglang:token_usage"}},
			want:  Load{Waiting: 1, Running: 2, Usage: 0.3, Requests: -1},
		},
		{
			name: "data parallel ranks add up their requests and average their KV usage",
			body: testutil.VLLMMetrics(1, 2, 0.2) + `vllm:num_requests_running{engine="1",model_name="m"} 4
vllm:num_requests_waiting{engine="1",model_name="m"} 3
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
`,
			names: Families,
			want:  Load{Waiting: 4, Running: 6, Usage: 0.4, Requests: -1},
		},
		{
			name:  "no KV usage gauge: usage unknown",
			body:  "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n",
			names: Families,
			want:  Load{Waiting: 0, Running: 1, Usage: -1, Requests: -1},
		},
		{
			name: "the count of requests served, summed over its finish reasons and ranks",
			body: testutil.VLLMMetrics(0, 1, 0.1) + `# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 40
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2
vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"} 3
`,
			names: Families,
			want:  Load{Waiting: 0, Running: 1, Usage: 0.1, Requests: 45},
		},
		{
			name:  "SGLang's count of requests",
			body:  sglangMetrics(0, 0, 0) + "# TYPE sglang:num_requests_total counter\nsglang:num_requests_total{model_name=\"m\"} 7\n",
			names: Families,
			want:  Load{Usage: 0, Requests: 7},
		},
		{
			name: "vLLM's prefix cache: tokens looked up less those found, against blocks times their size",
			body: testutil.VLLMMetrics(0, 1, 0.1) + `# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="50"} 1
`,
			names: Families,
			want:  Load{Running: 1, Usage: 0.1, Requests: -1, KV: KV{Stored: 1100, Capacity: 2400}},
		},
		{
			name: "SGLang's prefix cache: tokens found on the host tier are stored again",
			body: sglangMetrics(0, 0, 0) + `# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 5000
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="m"} 3000
sglang:cached_tokens_total{cache_source="host",model_name="m"} 500
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 161721
`,
			names: Families,
			want:  Load{Usage: 0, Requests: -1, KV: KV{Stored: 2000, Capacity: 161721}},
		},
		{
			name: "vLLM's info series before it counted its blocks: no capacity, not its value of 1",
			body: testutil.VLLMMetrics(0, 0, 0) + `vllm:prefix_cache_queries_total 10
vllm:prefix_cache_hits_total 0
vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1
`,
			names: Families,
			want:  Load{Requests: -1},
		},
		{
			name:  "the cache counters without a capacity say nothing",
			body:  testutil.VLLMMetrics(0, 0, 0) + "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 5\n",
			names: Families,
			want:  Load{Requests: -1},
		},
		{
			name:    "a negative count of requests",
			body:    "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:request_success_total -2\n",
			names:   Families,
			wantErr: "vllm:request_success_total is -2",
		},
		{
			name:    "only one of the two request gauges",
			body:    "vllm:num_requests_running 1\n",
			names:   Families,
			wantErr: "no load gauges: want vllm:num_requests_waiting and vllm:num_requests_running, or sglang:num_queue_reqs and sglang:num_running_reqs",
		},
		{
			name:    "not the text format",
			body:    "<html>",
			names:   Families,
			wantErr: "parse metrics",
		},
		{
			name:    "a NaN count",
			body:    "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
			names:   Families,
			wantErr: "vllm:num_requests_running is NaN",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse([]byte(tt.body), tt.names)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Parse error = %v, want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if got.Waiting != tt.want.Waiting || got.Running != tt.want.Running || fmt.Sprintf("%.6f", got.Usage) != fmt.Sprintf("%.6f", tt.want.Usage) {
				t.Errorf("Parse = waiting %d running %d usage %v, want %d %d %v", got.Waiting, got.Running, got.Usage, tt.want.Waiting, tt.want.Running, tt.want.Usage)
			}
			if got.KV != tt.want.KV {
				t.Errorf("Parse KV = %+v, want %+v", got.KV, tt.want.KV)
			}
		})
	}
}

func FuzzParse(f *testing.F) {
	f.Add(testutil.VLLMMetrics(1, 2, 0.5))
	f.Add(sglangMetrics(1, 2, 0.5))
	f.Add("vllm:num_requests_running -1\nvllm:num_requests_waiting +Inf\n")
	f.Add("# TYPE vllm:num_requests_running histogram\nvllm:num_requests_running_bucket{le=\"+Inf\"} 1\n")
	f.Fuzz(func(t *testing.T, body string) {
		l, err := Parse([]byte(body), Families)
		if err != nil {
			if l != (Load{}) {
				t.Fatalf("Parse returned a load with error %v", err)
			}
			return
		}
		if l.Waiting < 0 || l.Running < 0 || (l.Usage < 0 && l.Usage != -1) || l.KV.Stored < 0 || l.KV.Capacity < 0 {
			t.Fatalf("Parse(%q) = %+v: a count below zero or a usage neither known nor -1", body, l)
		}
	})
}
