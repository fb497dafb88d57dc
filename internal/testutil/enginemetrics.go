package testutil

import "fmt"

// VLLMMetrics is a vLLM /metrics body in the Prometheus text format reporting waiting and
// running requests and the KV cache usage (0 to 1), as an engine's scrape answers.
func VLLMMetrics(waiting, running int, usage float64) string {
	return fmt.Sprintf(`# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %d
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %d
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} %g
`, running, waiting, usage)
}
