package sim

import "github.com/prometheus/client_golang/prometheus"

// newRegistry builds the engine's own registry: several engines run in one
// process, so none of them may use the global one. The vllm: gauges mirror
// the names the proxy's router scrapes from real vLLM servers.
func (e *Engine) newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"model_name": e.cfg.Model}
	gauge := func(name, help string, f func(KVStats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(e.Stats()) })
	}
	counter := func(name, help string, f func(KVStats) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(e.Stats()) })
	}
	reg.MustRegister(
		gauge("vllm:num_requests_running", "Requests prefilling, pulling KV or decoding.",
			func(s KVStats) float64 { return float64(s.RunningRequests) }),
		gauge("vllm:num_requests_waiting", "Requests queued for KV blocks or a running slot.",
			func(s KVStats) float64 { return float64(s.WaitingRequests) }),
		gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks not free (in use or held), 0 to 1.",
			func(s KVStats) float64 { return float64(s.BlocksTotal-s.BlocksFree) / float64(s.BlocksTotal) }),
		gauge("pdproxy_sim_kv_blocks_held", "KV blocks held by finished prefills for a decoder's pull.",
			func(s KVStats) float64 { return float64(s.BlocksHeld) }),
		gauge("pdproxy_sim_rooms_waiting", "SGLang decoder: bootstrap rooms its requests wait for.",
			func(s KVStats) float64 { return float64(s.RoomsWaiting) }),
		gauge("pdproxy_sim_rooms_held", "SGLang prefiller: rooms holding KV whose transfer has not started.",
			func(s KVStats) float64 { return float64(s.RoomsHeld) }),
		counter("pdproxy_sim_kv_hold_expired_total", "Holds freed by the hold timeout.",
			func(s KVStats) float64 { return float64(s.ExpiredTotal) }),
		// vLLM's own name for the same count (PR #41383), so that a dashboard
		// or a proxy test written against vLLM reads the sim unchanged.
		counter("vllm:nixl_num_kv_expired_reqs_total", "Requests whose KV lease expired before a decoder read them.",
			func(s KVStats) float64 { return float64(s.ExpiredTotal) }),
		counter("pdproxy_sim_kv_heartbeats_total", "KV lease renewals applied from decoders' heartbeats.",
			func(s KVStats) float64 { return float64(s.HeartbeatsTotal) }),
		counter("pdproxy_sim_late_events_total", "Aborts and notifications that found nothing to act on.",
			func(s KVStats) float64 { return float64(s.LateEventsTotal) }),
		counter("pdproxy_sim_engine_crashes_total", "Engine deaths: every request failed (vLLM #50792).",
			func(s KVStats) float64 { return float64(s.EngineCrashesTotal) }),
		counter("pdproxy_sim_double_free_attempts_total", "Attempts to free KV blocks twice; must stay 0.",
			func(s KVStats) float64 { return float64(s.DoubleFreeAttemptsTotal) }),
	)
	return reg
}
