package kvcache

import (
	"github.com/prometheus/client_golang/prometheus"
)

// unknownBackend is the backend label of what cannot be told apart by backend: a message in
// the listening socket whose topic names no backend, or with no topic at all, and a
// connection to it closed before any message.
const unknownBackend = "unknown"

// metrics are the KV event series. The backend label is a backend's configured name, or
// unknownBackend.
type metrics struct {
	events  *prometheus.CounterVec
	dropped *prometheus.CounterVec
	resets  *prometheus.CounterVec
	replays *prometheus.CounterVec
	blocks  *prometheus.Desc
	index   *Index
}

func newMetrics(index *Index) *metrics {
	const ns = "pdproxy"
	return &metrics{
		index: index,
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "kv_events_total",
			Help: "KV events decoded from an engine's publisher, by type: block_stored, block_removed, all_blocks_cleared (replayed ones included).",
		}, []string{"backend", "type"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "kv_events_dropped_total",
			Help: "KV event messages or events not applied, by reason: frames (not [topic, 8-byte sequence, payload]), decode (a payload that is no batch of events), unknown_topic (a topic naming no backend), unknown_tag, malformed (token ids that do not fill the blocks), unknown_parent (blocks continuing a block the index does not know), extra_keys (blocks hashed with keys their event does not give: a lora_id without lora_name, a lora_name without extra_keys), index_full (a BlockStored past kv_events.max_blocks_per_backend or kv_events.max_blocks); and connections closed, by reason: too_large (a frame over 32 MiB, or a message over 32 MiB or 8 frames), unknown_source (on the listening socket, a peer at no backend's address and not in kv_events.allowed_sources; or, by the backend it named, a message whose topic names a backend at another address), too_many_peers (the listening socket holds 512 connections).",
		}, []string{"backend", "reason"}),
		resets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "kv_index_resets_total",
			Help: "Times the index forgot everything of an engine, by reason: cleared (AllBlocksCleared), sequence_reset (the sequence went back: the engine restarted), gap (messages lost and not replayed), removed (the backend left the config).",
		}, []string{"backend", "reason"}),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "kv_events_replays_total",
			Help: "Replays asked of an engine's replay endpoint, after a sequence gap or to catch up on what the engine published before the proxy's first message from it, by result: ok (after a gap: every missed batch came back), failed (no answer in time, or after a gap the engine no longer had them: the engine is forgotten).",
		}, []string{"backend", "result"}),
		blocks: prometheus.NewDesc(ns+"_kv_index_blocks",
			"Blocks the index holds for an engine, as its KV events told them.", []string{"backend"}, nil),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.events, m.dropped, m.resets, m.replays, m} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// forget deletes a removed backend's series.
func (m *metrics) forget(engine string) {
	for _, v := range []*prometheus.CounterVec{m.events, m.dropped, m.resets, m.replays} {
		v.DeletePartialMatch(prometheus.Labels{"backend": engine})
	}
}

// Describe implements prometheus.Collector for the index size.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) { ch <- m.blocks }

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	for name, s := range m.index.Engines() {
		ch <- prometheus.MustNewConstMetric(m.blocks, prometheus.GaugeValue, float64(s.Blocks), name)
	}
}
