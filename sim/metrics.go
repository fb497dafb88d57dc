package sim

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// newRegistry builds the engine's own registry: several engines run in one
// process, so none of them may use the global one. The load gauges carry the
// names the engine it plays reports and a proxy's router scrapes: vllm:* for
// the vllm protocol, sglang:* for sglang.
func (e *Engine) newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(&statsCollector{e: e, metrics: e.metricList()})
	return reg
}

// metric is one series of /metrics, read from a KVStats snapshot.
type metric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(KVStats) float64
}

// statsCollector reads every series from one KVStats snapshot per scrape, so
// that the gauges of one scrape agree with each other (the blocks in use with
// the requests running) as they do in the engine at that instant.
type statsCollector struct {
	e       *Engine
	metrics []metric
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.metrics {
		ch <- m.desc
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.Stats()
	for _, m := range c.metrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.kind, m.value(s))
	}
}

// kvUsage is the fraction of KV blocks not free: in use by requests or held
// for a decoder's read, as vLLM's kv_cache_usage_perc and SGLang's
// token_usage count them.
func kvUsage(s KVStats) float64 {
	if s.BlocksTotal == 0 {
		return 0
	}
	return float64(s.BlocksTotal-s.BlocksFree) / float64(s.BlocksTotal)
}

// hitRate is the prefix cache's hits over its queries, 0 before any.
func hitRate(s KVStats) float64 {
	if s.PrefixCacheQueriesTotal == 0 {
		return 0
	}
	return float64(s.PrefixCacheHitsTotal) / float64(s.PrefixCacheQueriesTotal)
}

func (e *Engine) metricList() []metric {
	labels := prometheus.Labels{"model_name": e.defaultModel()}
	var out []metric
	add := func(kind prometheus.ValueType, name, help string, f func(KVStats) float64) {
		out = append(out, metric{prometheus.NewDesc(name, help, nil, labels), kind, f})
	}
	gauge := func(name, help string, f func(KVStats) float64) { add(prometheus.GaugeValue, name, help, f) }
	counter := func(name, help string, f func(KVStats) float64) { add(prometheus.CounterValue, name, help, f) }

	running := func(s KVStats) float64 { return float64(s.RunningRequests) }
	waiting := func(s KVStats) float64 { return float64(s.WaitingRequests) }
	requests := func(s KVStats) float64 { return float64(s.RequestsTotal) }
	if e.cfg.Protocol == ProtocolSGLang {
		gauge("sglang:num_running_reqs", "Requests prefilling, pulling KV or decoding (holding a running slot and KV blocks).", running)
		gauge("sglang:num_queue_reqs", "Requests queued for KV blocks or a running slot.", waiting)
		gauge("sglang:token_usage", "Fraction of KV blocks not free (in use or held for a decoder), 0 to 1.", kvUsage)
		gauge("sglang:num_decode_prealloc_queue_reqs", "Decoder: requests waiting for their bootstrap room's KV (rooms_waiting).",
			func(s KVStats) float64 { return float64(s.RoomsWaiting) })
		counter("sglang:num_requests_total", "Requests the scheduler accepted, from every client.", requests)
		counter("sglang:prompt_tokens_total", "Prompt tokens of the requests prefilled.",
			func(s KVStats) float64 { return float64(s.PrefixCacheQueriesTotal) })
		counter("sglang:cached_tokens_total", "Prompt tokens found in the prefix cache.",
			func(s KVStats) float64 { return float64(s.PrefixCacheHitsTotal) })
		gauge("sglang:max_total_num_tokens", "Tokens the KV pools of every data parallel rank hold.",
			func(s KVStats) float64 { return float64(s.BlocksTotal * e.cfg.BlockSize) })
	} else {
		gauge("vllm:num_requests_running", "Requests prefilling, pulling KV or decoding (holding a running slot and KV blocks).", running)
		gauge("vllm:num_requests_waiting", "Requests queued for KV blocks or a running slot.", waiting)
		gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks not free (in use or held for a decoder), 0 to 1.", kvUsage)
		counter("vllm:request_success_total", "Requests the scheduler accepted, from every client (vLLM counts them as they finish).", requests)
		// vLLM's own name for the hold expiries (PR #41383), so that a dashboard
		// or a proxy test written against vLLM reads the sim unchanged.
		counter("vllm:nixl_num_kv_expired_reqs_total", "Requests whose KV lease expired before a decoder read them.",
			func(s KVStats) float64 { return float64(s.ExpiredTotal) })
		counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
			func(s KVStats) float64 { return float64(s.PrefixCacheQueriesTotal) })
		counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
			func(s KVStats) float64 { return float64(s.PrefixCacheHitsTotal) })
		// vLLM's info series, one per data parallel rank (its engine index): each rank's pool
		// size in its labels, its value 1.
		for rank := range max(e.cfg.DataParallelSize, 1) {
			info := prometheus.Labels{"model_name": e.defaultModel(), "engine": strconv.Itoa(rank),
				"block_size": strconv.Itoa(e.cfg.BlockSize), "num_gpu_blocks": strconv.Itoa(e.cfg.KVBlocks)}
			out = append(out, metric{prometheus.NewDesc("vllm:cache_config_info", "The KV cache's configuration, in its labels.", nil, info),
				prometheus.GaugeValue, func(KVStats) float64 { return 1 }})
		}
		if e.cfg.CPUOffloadBlocks > 0 {
			// vLLM's names for what its KV connector loads, here the CPU tier.
			counter("vllm:external_prefix_cache_queries_total", "Prompt tokens looked up in the CPU KV tier.",
				func(s KVStats) float64 { return float64(s.ExternalPrefixCacheQueriesTotal) })
			counter("vllm:external_prefix_cache_hits_total", "Prompt tokens reloaded from the CPU KV tier instead of computed.",
				func(s KVStats) float64 { return float64(s.ExternalPrefixCacheHitsTotal) })
		}
	}
	if e.cfg.Protocol == ProtocolSGLang {
		gauge("sglang:cache_hit_rate", "Prefix cache hit rate: prompt tokens found cached over those looked up, 0 to 1.", hitRate)
	}
	counter("pdproxy_sim_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
		func(s KVStats) float64 { return float64(s.PrefixCacheQueriesTotal) })
	counter("pdproxy_sim_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
		func(s KVStats) float64 { return float64(s.PrefixCacheHitsTotal) })
	counter("pdproxy_sim_prompt_tokens_computed_total", "Prompt tokens computed here: neither in the prefix cache, reloaded from the CPU tier, nor pulled.",
		func(s KVStats) float64 { return float64(s.PromptTokensComputedTotal) })
	counter("pdproxy_sim_external_prefix_cache_queries_total", "Prompt tokens looked up in the CPU KV tier (0 without one).",
		func(s KVStats) float64 { return float64(s.ExternalPrefixCacheQueriesTotal) })
	counter("pdproxy_sim_external_prefix_cache_hits_total", "Prompt tokens reloaded from the CPU KV tier instead of computed.",
		func(s KVStats) float64 { return float64(s.ExternalPrefixCacheHitsTotal) })
	gauge("pdproxy_sim_kv_cpu_cached_blocks", "KV blocks the CPU tier holds (0 without one).",
		func(s KVStats) float64 { return float64(s.CPUCachedBlocks) })
	gauge("pdproxy_sim_kv_cached_blocks", "KV blocks in the prefix cache, referenced by requests or not.",
		func(s KVStats) float64 { return float64(s.CachedBlocks) })
	counter("pdproxy_sim_kv_blocks_pulled_total", "KV blocks a decoder pulled from prefillers (those its own cache lacked).",
		func(s KVStats) float64 { return float64(s.KVBlocksPulledTotal) })
	gauge("pdproxy_sim_kv_blocks_held", "KV blocks held by finished prefills for a decoder's pull.",
		func(s KVStats) float64 { return float64(s.BlocksHeld) })
	gauge("pdproxy_sim_rooms_waiting", "SGLang decoder: bootstrap rooms its requests wait for.",
		func(s KVStats) float64 { return float64(s.RoomsWaiting) })
	gauge("pdproxy_sim_rooms_held", "SGLang prefiller: rooms holding KV whose transfer has not started.",
		func(s KVStats) float64 { return float64(s.RoomsHeld) })
	counter("pdproxy_sim_kv_hold_expired_total", "Holds freed by the hold timeout.",
		func(s KVStats) float64 { return float64(s.ExpiredTotal) })
	counter("pdproxy_sim_kv_heartbeats_total", "KV lease renewals applied from decoders' heartbeats.",
		func(s KVStats) float64 { return float64(s.HeartbeatsTotal) })
	counter("pdproxy_sim_late_events_total", "Aborts and notifications that found nothing to act on.",
		func(s KVStats) float64 { return float64(s.LateEventsTotal) })
	counter("pdproxy_sim_engine_crashes_total", "Engine deaths: every request failed (vLLM #50792).",
		func(s KVStats) float64 { return float64(s.EngineCrashesTotal) })
	counter("pdproxy_sim_pooling_requests_total", "Pooling-style requests taken (embeddings, pooling, score, rerank, detokenize, transcriptions).",
		func(s KVStats) float64 { return float64(s.PoolingRequestsTotal) })
	counter("pdproxy_sim_pooling_aborted_total", "Pooling-style requests stopped because their client left before the answer.",
		func(s KVStats) float64 { return float64(s.PoolingAbortedTotal) })
	counter("pdproxy_sim_double_free_attempts_total", "Attempts to free KV blocks twice; must stay 0.",
		func(s KVStats) float64 { return float64(s.DoubleFreeAttemptsTotal) })
	return out
}
