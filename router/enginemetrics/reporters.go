package enginemetrics

// LoadReporter is implemented by an engine kind whose /metrics report its load under names it
// knows. Without it the families are tried in turn: vLLM's, then SGLang's.
type LoadReporter interface {
	// LoadMetrics names the gauges of requests waiting (queued, not yet running), requests
	// running, and the KV cache usage as a fraction from 0 to 1 ("" if none), and the counter
	// of the requests the engine has served ("" if none).
	LoadMetrics() (waiting, running, kvUsage, requests string)
}

// CacheReporter is implemented by a LoadReporter whose /metrics also count the prompt tokens
// it stored in its KV pool against the pool's size (CacheNames): from them the cache-aware
// policies tell what text routed to it has been evicted since.
type CacheReporter interface {
	// CacheMetrics names the counter of prompt tokens sent (or looked up in the prefix cache),
	// the counter of those found cached, and the KV capacity, a gauge of tokens or an info
	// series with num_gpu_blocks and block_size labels.
	CacheMetrics() (prompt, cached, capacity string)
}

// NamesOf are the series engine kind e is read by: its own where it is a LoadReporter, else
// Families.
func NamesOf(e any) []Names {
	lr, ok := e.(LoadReporter)
	if !ok {
		return Families
	}
	w, r, u, n := lr.LoadMetrics()
	names := Names{Waiting: w, Running: r, Usage: u, Requests: n}
	if cr, ok := e.(CacheReporter); ok {
		p, c, k := cr.CacheMetrics()
		names.Cache = CacheNames{Prompt: p, Cached: c, Capacity: k}
	}
	return []Names{names}
}
